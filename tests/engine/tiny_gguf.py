"""A tiny random-weight Llama written as a GGUF file the way llama.cpp lays one out (q/k rows
permuted for its rotary kernel, dimensions innermost first), each 2-D tensor in a block type of the
test's choosing: quantized by the `gguf` package where it can (Q4_0 ... Q8_0), random valid blocks
for the K-quants (which it cannot make)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

VOCAB = 512
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
# Byte offsets of the float16 scale fields of each K-quant block: random bytes there could be inf.
_K_HALF_FIELDS = {"Q4_K": [0, 2], "Q6_K": [208]}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _quantized(w: np.ndarray, type_name: str, rng: np.random.Generator):
    """(bytes [rows, row_bytes], GGML type) of a float weight [rows, cols] in that block type."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name not in _K_HALF_FIELDS:
        return gguf.quants.quantize(w.astype(np.float32), qtype), qtype
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, blocks = w.shape[0], w.shape[1] // values
    raw = rng.integers(0, 256, size=(rows, blocks, nbytes), dtype=np.uint8)
    for at in _K_HALF_FIELDS[type_name]:
        halves = rng.uniform(-0.002, 0.002, size=(rows, blocks)).astype(np.float16)
        raw[:, :, at:at + 2] = halves.view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, -1), qtype


def write_tiny_gguf(path: Path, types: dict[str, str], seed: int = 0, intermediate: int = INTERMEDIATE,
                    peaked: bool = False) -> Path:
    """`types`: GGUF tensor kind (attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down,
    token_embd, output) -> block type name; kinds not named stay F32. `peaked`: an LM head of its
    own ("output"), scaled up so that the top logits stand far apart and greedy choices never hinge
    on summation order (tensor-parallel ranks add in another order)."""
    import gguf
    from tokenizers.pre_tokenizers import ByteLevel

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": LAYERS, "embedding_length": HIDDEN, "head_count": HEADS,
                       "head_count_kv": KV_HEADS, "feed_forward_length": intermediate,
                       "layer_norm_rms_eps": 1e-5, "rope_freq_base": 10000.0, "context_length": 512}.items():
        getattr(w, f"add_{key}")(value)
    tokens = sorted(ByteLevel.alphabet()) + ["ab"]
    tokens += [f"<filler{i}>" for i in range(VOCAB - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(["a b"])
    w.add_eos_token_id(VOCAB - 1)

    def add(name: str, kind: str, shape: tuple[int, ...], scale: float = 0.05) -> None:
        t = rng.standard_normal(shape).astype(np.float32) * scale
        if kind == "attn_q":
            t = _permute(t, HEADS)
        elif kind == "attn_k":
            t = _permute(t, KV_HEADS)
        if kind in types:
            data, qtype = _quantized(t, types[kind], rng)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            w.add_tensor(name, t)

    add("token_embd.weight", "token_embd", (VOCAB, HIDDEN), 0.5)
    if peaked:
        add("output.weight", "output", (VOCAB, HIDDEN), 25.0)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for i in range(LAYERS):
        for kind, shape in (("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (KV_HEADS * HEAD_DIM, HIDDEN)),
                            ("attn_v", (KV_HEADS * HEAD_DIM, HIDDEN)), ("attn_output", (HIDDEN, HIDDEN)),
                            ("ffn_gate", (intermediate, HIDDEN)), ("ffn_up", (intermediate, HIDDEN)),
                            ("ffn_down", (HIDDEN, intermediate))):
            add(f"blk.{i}.{kind}.weight", kind, shape)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(HIDDEN, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def quantized_file_bytes(path: Path) -> int:
    """Bytes of the file's tensors stored in block types (what `gguf` keeps as stored)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors
               if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16))


def greedy(model: str, prompts: list[list[int]], max_tokens: int, **engine) -> list[list[int]]:
    from meshserve import LLM, SamplingParams

    llm = LLM(model, device="cpu", **engine)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.engine.shutdown()
