"""Llama-family decoder (Llama 2/3, Mistral, Qwen2 with attention bias, SmolLM) with TP/PP-aware layers.

The MoE families (models/qwen_moe.py, models/mixtral.py) reuse these pieces: the decoder layer takes
its MLP as an argument, and the attention gains Qwen3's per-head query/key norm when the config has it.
"""
from __future__ import annotations

import torch
from torch import nn

from meshserve.distributed.parallel_state import get_parallel_state
from meshserve.layers.activation import silu_and_mul
from meshserve.layers.attention import AttentionMetadata, PagedAttention
from meshserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from meshserve.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from meshserve.layers.norm import RMSNorm
from meshserve.layers.rotary import Positions, RotaryEmbedding
from meshserve.layers.weight_loader import weight_loader
from meshserve.models.cpu_decoder_stack import CPUDecoderStack
from meshserve.models.model_config import ModelConfig
from meshserve.models.registry import register_model
from meshserve.models.sharding import resolve_pipeline_split

# A layer's KV-cache scales in the checkpoint (vLLM's k_scale / v_scale, under the names the fp8
# quantizers write), for an fp8 KV cache; a cache in the compute dtype ignores them.
KV_SCALE_NAMES = {".self_attn.k_scale": ("k",), ".self_attn.v_scale": ("v",), ".self_attn.k_proj.k_scale": ("k",),
                  ".self_attn.v_proj.v_scale": ("v",), ".self_attn.k_proj.output_scale": ("k",),
                  ".self_attn.v_proj.output_scale": ("v",), ".self_attn.kv_scale": ("k", "v")}
_KV_SCALE_SUFFIXES = tuple(KV_SCALE_NAMES)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        head_dim = cfg.head_dim
        assert head_dim is not None, "ModelConfig.__post_init__ fills head_dim"
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=cfg.attention_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * head_dim, cfg.hidden_size)
        self.rotary = rotary
        self.attn = PagedAttention()  # runs on whichever backend built the step's metadata

    # The rotary kernel may store K/V as it rotates: false where the heads change before the rotation.
    rotates_fused_qkv = True

    def forward(self, positions: Positions, h, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(h)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if self.rotates_fused_qkv and self.attn.reads_cache_only(meta) and self.rotary.stores_kv(qkv, k_cache):
            q, _, _ = self.rotary.apply_qkv(positions, qkv, self.num_heads, self.num_kv_heads,
                                            store=(meta.slot_mapping, k_cache, v_cache))
            o = self.attn.attend_cached(q, k_cache, v_cache, meta)
        else:
            q, k, v = self.rotated_qkv(positions, qkv)
            o = self.attn(q, k, v, k_cache, v_cache, meta)
        return self.o_proj(o.reshape(h.shape[0], self.num_heads * self.head_dim))

    def rotated_qkv(self, positions, qkv: torch.Tensor):
        return self.rotary.apply_qkv(positions, qkv, self.num_heads, self.num_kv_heads)


class QKNormAttention(LlamaAttention):
    """Qwen3: each query and key head is RMS-normalised (one weight vector over head_dim) before the
    rotary embedding."""
    rotates_fused_qkv = False

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__(cfg, rotary)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def rotated_qkv(self, positions, qkv: torch.Tensor):
        t, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q = self.q_norm(q.reshape(t * self.num_heads, d)).view(t, self.num_heads, d)
        k = self.k_norm(k.reshape(t * self.num_kv_heads, d)).view(t, self.num_kv_heads, d)
        q, k = self.rotary(positions, q, k)
        return q, k, v.reshape(t, self.num_kv_heads, d)


class LlamaMLP(nn.Module):
    """SwiGLU MLP, gate/up column-parallel and down row-parallel. `reduce_results=False` leaves the
    TP partial sum for the caller to reduce (a shared expert inside an MoE block)."""

    def __init__(self, hidden_size: int, intermediate_size: int, reduce_results: bool = True):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """`mlp`: the feed-forward block (default: the dense SwiGLU MLP); an MoE block fits the same slot."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = (QKNormAttention if cfg.qk_norm else LlamaAttention)(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = mlp if mlp is not None else LlamaMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, positions, h, residual, kv_cache, meta):
        """Takes and returns the pair (sub-layer output, residual stream) whose sum is the layer's
        hidden state; each norm adds the pending output into the stream as it normalises.
        residual None: h is the whole hidden state (first layer of a stage)."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions, h, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


def stage_layers(num_layers: int, pp_size: int, pp_rank: int, split: list[int] | None = None) -> range:
    """The contiguous layers of one pipeline stage (even split by default, see resolve_pipeline_split)."""
    split = resolve_pipeline_split(num_layers, pp_size, split)
    start = sum(split[:pp_rank])
    return range(start, start + split[pp_rank])


@register_model("LlamaForCausalLM", "MistralForCausalLM", gguf="llama")
@register_model("Qwen2ForCausalLM", gguf="qwen2")
class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our parameter fragment, shard id)
    STACKED = {
        ".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"), ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, cfg: ModelConfig, pp_split: list[int] | None = None):
        super().__init__()
        ps = get_parallel_state()
        self.cfg = cfg
        self.layer_range = stage_layers(cfg.num_hidden_layers, ps.pp_size, ps.pp_rank, pp_split)
        self.is_first, self.is_last = ps.is_first_stage, ps.is_last_stage
        assert cfg.head_dim is not None, "ModelConfig.__post_init__ fills head_dim"
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.rotary = rotary  # every layer's: the model gathers a step's cos/sin rows once for all of them
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if self.is_first else None
        self.layers = nn.ModuleDict({str(i): self.make_layer(cfg, i, rotary) for i in self.layer_range})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.is_last else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size) if self.is_last else None
        if cfg.tie_word_embeddings and self.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight  # one table for both, as the checkpoint has
        self.cpu_stack: CPUDecoderStack | None = None  # set by use_cpu_stack once the weights are packed

    def use_cpu_stack(self) -> None:
        """Run the layers through the C++ loop when they qualify (models/cpu_decoder_stack.py);
        cpu_gemm.prepack_model calls it once the weights are packed."""
        self.cpu_stack = CPUDecoderStack.build(self.decoder_layers(), get_parallel_state().tp_size,
                                              LlamaAttention, LlamaMLP)

    def make_layer(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> LlamaDecoderLayer:
        return LlamaDecoderLayer(cfg, rotary)

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """This stage's layers in order, as make_layer built them (an nn.ModuleDict holds them as
        plain Modules)."""
        layers = []
        for layer in self.layers.values():
            assert isinstance(layer, LlamaDecoderLayer)
            layers.append(layer)
        return layers

    def forward(self, input_ids, positions, kv_caches, meta, hidden=None) -> torch.Tensor:
        """First stage takes token ids, later stages the previous stage's hidden states. Returns the
        hidden states after this stage's layers (final-normed on the last stage)."""
        # A later stage's input becomes its residual stream, which the fused norms update in place.
        h = self.embed_tokens(input_ids) if self.embed_tokens is not None else hidden.clone()
        residual = None
        if self.cpu_stack is not None and self.cpu_stack.accepts(h, kv_caches, meta):
            h, residual = self.cpu_stack(positions, h, kv_caches, meta)
        else:
            rows = self.rotary.at(positions)
            for i, layer in self.layers.items():
                h, residual = layer(rows, h, residual, kv_caches[int(i) - self.layer_range.start], meta)
        if residual is None:  # a stage without layers
            return self.norm(h) if self.norm is not None else h
        return self.norm(h, residual)[0] if self.norm is not None else h + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "only the last stage has the LM head"
        return self.lm_head(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """argmax(compute_logits(hidden), -1) without the logits where the LM head can; else None."""
        assert self.lm_head is not None, "only the last stage has the LM head"
        return self.lm_head.greedy_tokens(hidden)

    def load_weights(self, weights) -> None:
        """Take (HF name, full tensor) pairs; each parameter copies its own shard."""
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name.startswith("model.layers."):
                layer = int(name.split(".")[2])
                if layer not in self.layer_range:
                    continue
                if name.endswith(_KV_SCALE_SUFFIXES):
                    self.load_kv_scale(self.decoder_layers()[layer - self.layer_range.start], name, tensor)
                    continue
            targets: list[tuple[str, object]] = []
            if name == "model.embed_tokens.weight":
                targets.append(("embed_tokens.weight", None))
                if self.cfg.tie_word_embeddings:
                    targets.append(("lm_head.weight", None))
            else:
                targets.append(self.checkpoint_target(name.removeprefix("model.")))
            for local, shard in targets:
                p = params.get(local)
                if p is None:
                    continue  # another pipeline stage owns it
                load = weight_loader(p)  # the layer's own; a plain copy for a parameter without one
                if shard is None:
                    load(p, tensor)
                else:
                    load(p, tensor, shard)

    @staticmethod
    def load_kv_scale(layer: LlamaDecoderLayer, name: str, tensor: torch.Tensor) -> None:
        """One of KV_SCALE_NAMES into the layer's PagedAttention; a per-head scale counts as its
        largest (no stored value overflows)."""
        attn = layer.self_attn.attn
        value = float(tensor.float().max())
        if not 0.0 < value < float("inf"):
            raise ValueError(f"{name}: a KV-cache scale must be positive and finite, got {value}")
        which = next(w for suffix, w in KV_SCALE_NAMES.items() if name.endswith(suffix))
        attn.kv_scales = attn.kv_scales._replace(**dict.fromkeys(which, value))

    def checkpoint_target(self, local: str) -> tuple[str, object]:
        """(our parameter name, shard id or None) for a checkpoint tensor name without 'model.'."""
        for frag, (ours, sid) in self.STACKED.items():
            if frag in local:
                return local.replace(frag, ours), sid
        return local, None
