"""GGUF files of the MoE families load to the same model as their HF directories. The files are written
here the way llama.cpp's converter lays them out: experts stacked per layer into one tensor per
projection, Qwen2-MoE's shared-expert gate as a vector, q/k rows permuted for the Llama-style
rotary kernel in the llama architecture (Mixtral) and left alone in qwen3moe / qwen2moe. A small
vocabulary with a synthetic byte-level tokenizer keeps the files quick to read."""
import pytest
import torch
from moe_helpers import hf_greedy, make_tiny_moe, prompts, run_greedy
from safetensors.torch import load_file

from meshserve.models.model_config import ModelConfig

VOCAB = 512

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
               "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
EXPERT_NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order for the llama architecture."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(hf_dir: str, out: str, family: str, expert_type: str | None = None) -> None:
    """`expert_type`: the routed experts' tensors in that block type (else float32)."""
    import gguf

    cfg = ModelConfig.from_json_file(f"{hf_dir}/config.json")
    arch = GGUF_ARCH[family]
    w = gguf.GGUFWriter(out, arch)
    metadata = {
        "block_count": cfg.num_hidden_layers, "embedding_length": cfg.hidden_size,
        "head_count": cfg.num_attention_heads, "head_count_kv": cfg.num_key_value_heads,
        "key_length": cfg.head_dim, "value_length": cfg.head_dim, "feed_forward_length": cfg.intermediate_size,
        "layer_norm_rms_eps": cfg.rms_norm_eps, "rope_freq_base": cfg.rope_theta,
        "context_length": cfg.max_position_embeddings, "expert_count": cfg.num_experts,
        "expert_used_count": cfg.num_experts_per_tok,
        # llama.cpp writes no expert width for Mixtral (it is feed_forward_length) and a shared width only if any.
        "expert_feed_forward_length": cfg.moe_intermediate_size if family != "mixtral" else None,
        "expert_shared_feed_forward_length": cfg.shared_expert_intermediate_size or None,
    }
    for key, value in metadata.items():
        if value is not None:
            getattr(w, f"add_{key}")(value)
    _add_byte_level_tokenizer(w)
    tensors, experts = {}, {}
    for name, t in load_file(f"{hf_dir}/model.safetensors").items():
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            tensors[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]] = t
            continue
        _, _, layer, rest = name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        if ".experts." in module:
            expert, projection = module.split(".experts.")[1].split(".")
            experts.setdefault((layer, EXPERT_NAMES[projection]), {})[int(expert)] = t
            continue
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            t = _permute(t, cfg.num_attention_heads if "q_proj" in module else cfg.num_key_value_heads)
        if module == "mlp.shared_expert_gate":
            t = t.reshape(-1)
        tensors[f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"] = t
    for (layer, which), by_expert in experts.items():
        tensors[f"blk.{layer}.ffn_{which}_exps.weight"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    for name, t in tensors.items():
        if expert_type and name.endswith("_exps.weight"):
            qtype = gguf.GGMLQuantizationType[expert_type]
            data = gguf.quants.quantize(t.float().numpy(), qtype)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            w.add_tensor(name, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add_byte_level_tokenizer(w) -> None:
    """GPT-2 style byte-level BPE: the 256 byte symbols, one merge, fillers up to VOCAB."""
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = sorted(ByteLevel.alphabet()) + ["ab"]
    tokens += [f"<filler{i}>" for i in range(VOCAB - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(["a b"])
    w.add_eos_token_id(VOCAB - 1)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_gguf_matches_transformers(tmp_path, family):
    model = make_tiny_moe(tmp_path / "hf", family, vocab_size=VOCAB)
    ids = [[t % VOCAB for t in p] for p in prompts()]
    _write_gguf(str(tmp_path / "hf"), str(tmp_path / f"{family}.gguf"), family)
    got, load, _ = run_greedy(str(tmp_path / f"{family}.gguf"), prompt_ids=ids)
    assert got == hf_greedy(model, ids)
    cfg = ModelConfig.from_json_file(tmp_path / "hf" / "config.json")
    assert load["layers"] == [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_quantized_experts_are_served_as_stored(tmp_path, family):
    """Routed experts a file stores in Q8_0 stay in its blocks and compute what the same blocks
    dequantized compute (the GEMV on its float path: the exact product)."""
    from meshserve.config import EngineConfig
    from meshserve.eval.perplexity import load_runner, token_logprobs
    from meshserve.layers import cpu_kernels
    from meshserve.layers.moe import GroupedExperts
    from meshserve.layers.quantization.blocks import BlockType

    make_tiny_moe(tmp_path / "hf", family, vocab_size=VOCAB)
    path = str(tmp_path / "q8.gguf")
    _write_gguf(str(tmp_path / "hf"), path, family, expert_type="Q8_0")
    stored = load_runner(EngineConfig(model=path, device="cpu"), 128)
    experts = [m for m in stored.model.modules() if isinstance(m, GroupedExperts)]
    assert experts and all(m.quant is not None and m.w13.numel() == 0 for m in experts)
    assert {s.blocks.block_type for m in experts for pair in m.quant for q in pair for s in q.segments} == {
        BlockType.Q8_0}
    dense = load_runner(EngineConfig(model=path, device="cpu", quantization="none", dtype="float32"), 128)
    ids = [t % VOCAB for t in range(5, 70, 3)]
    previous = cpu_kernels.set_quant_isa("float")
    try:
        for chunk in (3, 32):
            torch.testing.assert_close(token_logprobs(stored, ids, chunk), token_logprobs(dense, ids, chunk),
                                       rtol=0, atol=2e-3)
    finally:
        cpu_kernels.set_quant_isa(previous)
