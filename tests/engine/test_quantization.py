"""Quantized weights through the engine (--quantization none | gguf | int8 | fp8): a GGUF file's
blocks are kept as stored (the resident bytes are the file's), give the model the dequantized
weights give, split over tensor-parallel ranks only at block boundaries, and run through the C++
layer loop bit for bit as through the modules; int8 and fp8 are made at load from float weights or
read from an fp8 checkpoint; and accuracy holds as users measure it: perplexity on held-out text and
greedy agreement with the float32 model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_gguf import greedy, quantized_file_bytes, write_tiny_gguf

from meshserve.config import EngineConfig
from meshserve.eval.perplexity import (
    load_runner,
    next_token_logprobs,
    perplexity,
    perplexity_of,
    token_logprobs,
    top1_agreement,
)
from meshserve.layers import cpu_kernels
from meshserve.layers.quantization.blocks import BlockType
from meshserve.layers.quantization.reference import FP8_E4M3_MAX
from meshserve.models.loader import resolve_model

HELDOUT = Path(__file__).parent / "data" / "heldout.txt"
MIXED = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_0", "ffn_gate": "Q4_1",
         "ffn_up": "Q5_0", "ffn_down": "Q5_1", "token_embd": "Q8_0", "output": "Q8_0"}
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(40, 75))]


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf", MIXED)


def _runner(model: str, **engine):
    # float32 unless a test says otherwise: the dequantized weights' products are the reference
    return load_runner(EngineConfig(model=model, device="cpu", **{"dtype": "float32", **engine}), 256)


def test_gguf_keeps_the_files_blocks_as_stored(mixed_gguf):
    runner = _runner(str(mixed_gguf))
    assert runner.config.quantization == "gguf"  # the default for a GGUF file
    # the tied embedding and LM head share one copy: exactly the file's quantized bytes
    assert runner.weight_bytes.quantized == quantized_file_bytes(mixed_gguf)
    assert runner.weight_bytes.dense < 20_000  # the norms only
    layer = runner.model.layers["0"]
    assert [s.blocks.block_type for s in layer.self_attn.qkv_proj.quant.segments] == [BlockType.Q4_K, BlockType.Q6_K]
    assert layer.mlp.down_proj.quant.blocks.block_type == BlockType.Q5_1
    assert runner.model.cpu_stack is None  # a projection in two block types keeps the module path


@pytest.fixture
def float_activations():
    """qgemv on its float path: the exact product with the dequantized weight (its integer paths
    round the activations to int8 per 32 values first, as llama.cpp does; their accuracy is the
    embedded model's perplexity below, and test_quant_gemv.py's)."""
    previous = cpu_kernels.set_quant_isa("float")
    yield
    cpu_kernels.set_quant_isa(previous)


@pytest.mark.parametrize("chunk", [4, 64])  # decode-sized rows (the GEMV of the blocks) and prefill rows
def test_gguf_scores_as_the_dequantized_weights(mixed_gguf, chunk, float_activations):
    ids = [(7 * i + 3) % 500 for i in range(80)]
    as_stored = token_logprobs(_runner(str(mixed_gguf)), ids, chunk)
    dequantized = token_logprobs(_runner(str(mixed_gguf), quantization="none"), ids, chunk)
    # Both sum in float32, in different orders: the blocks' GEMV against oneDNN's blocked kernel on the
    # dequantized weight (past 3 rows on AVX-512), which this tiny model's logits magnify to ~2e-3.
    torch.testing.assert_close(as_stored, dequantized, rtol=0, atol=4e-3)


def test_gguf_greedy_over_tensor_parallel_ranks(tmp_path):
    path = str(write_tiny_gguf(tmp_path / "peaked.gguf", MIXED, peaked=True))
    one = greedy(path, PROMPTS, 12)
    assert one == greedy(path, PROMPTS, 12, quantization="none", dtype="float32")
    assert one == greedy(path, PROMPTS, 12, tensor_parallel_size=2)


def test_a_split_that_cuts_blocks_is_refused_naming_sizes_that_work(tmp_path):
    path = write_tiny_gguf(tmp_path / "k.gguf", {"ffn_down": "Q4_K"}, intermediate=256)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_down\.weight: 256 values per row in Q4_K blocks of 256 "
                                         r"cannot be split into 2 parts.*tensor_parallel_size that work: 1$"):
        greedy(str(path), PROMPTS, 4, tensor_parallel_size=2)


def test_the_cpu_layer_loop_runs_quantized_layers_bit_for_bit(tmp_path):
    types = {k: "Q4_1" for k in MIXED if k not in ("token_embd", "output")} | {"attn_output": "Q8_0"}
    path = write_tiny_gguf(tmp_path / "one.gguf", types)
    runner = _runner(str(path))
    assert runner.model.cpu_stack is not None
    ids = [(5 * i + 1) % 500 for i in range(40)]
    for chunk in (3, 40):
        fast = token_logprobs(runner, ids, chunk)
        stack, runner.model.cpu_stack = runner.model.cpu_stack, None
        plain = token_logprobs(runner, ids, chunk)
        runner.model.cpu_stack = stack
        assert torch.equal(fast, plain)


def _tiny_hf(path: Path) -> Path:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("method,block_type", [("int8", BlockType.INT8_ROWS), ("fp8", BlockType.FP8_E4M3_ROWS)])
def test_int8_and_fp8_are_made_at_load(tmp_path, method, block_type):
    model = str(_tiny_hf(tmp_path / "hf"))
    runner = _runner(model, quantization=method)
    layer = runner.model.layers["0"]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert linear.quant.blocks.block_type == block_type and linear.weight.numel() == 0
    assert runner.model.lm_head.quant is None and runner.model.embed_tokens.quant is None
    # one byte per linear weight value plus a float32 scale per row, the rest as it was
    dense = _runner(model)
    linear_values = sum(p.numel() for n, p in dense.model.named_parameters() if n.endswith("proj.weight"))
    linear_rows = sum(p.shape[0] for n, p in dense.model.named_parameters() if n.endswith("proj.weight"))
    assert runner.weight_bytes.quantized == linear_values + 4 * linear_rows
    ids = [(11 * i) % 300 for i in range(60)]
    got, ref = token_logprobs(runner, ids, 8), token_logprobs(dense, ids, 8)
    assert (got - ref).abs().max() < 0.05


def test_an_fp8_checkpoint_is_read_with_its_scales(tmp_path):
    """An fp8 checkpoint (weights float8_e4m3fn, weight_scale per tensor or per channel, and an
    input_scale, as such checkpoints carry) scores exactly as a float checkpoint of its dequantized
    values; quantization is taken from its config."""
    from safetensors.torch import load_file, save_file

    src = _tiny_hf(tmp_path / "hf")
    tensors = load_file(str(src / "model.safetensors"))
    fp8, exact = {}, {}
    for i, (name, t) in enumerate(sorted(tensors.items())):
        if name.endswith("proj.weight"):
            scale = t.abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX if i % 2 else t.abs().amax() / FP8_E4M3_MAX
            q = (t / scale).to(torch.float8_e4m3fn)
            fp8[name], fp8[name + "_scale"] = q, scale.float()
            fp8[name.removesuffix("weight") + "input_scale"] = torch.tensor(1.0)
            exact[name] = q.float() * scale
        else:
            fp8[name] = exact[name] = t
    for directory, weights, extra in ((tmp_path / "fp8", fp8, {"quantization_config": {"quant_method": "fp8"}}),
                                      (tmp_path / "exact", exact, {})):
        directory.mkdir()
        save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
        config = json.loads((src / "config.json").read_text()) | extra
        (directory / "config.json").write_text(json.dumps(config))
    runner = _runner(str(tmp_path / "fp8"))
    assert runner.config.quantization == "fp8"
    assert runner.model.layers["1"].mlp.down_proj.quant.blocks.block_type == BlockType.FP8_E4M3_ROWS
    ids = [(13 * i) % 300 for i in range(50)]
    exact = _runner(str(tmp_path / "exact"))
    torch.testing.assert_close(token_logprobs(runner, ids, 64), token_logprobs(exact, ids, 64), rtol=0, atol=1e-4)


def test_bad_quantization_settings_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="quantization must be one of none, gguf, int8, fp8, got 'q4'"):
        EngineConfig(quantization="q4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="quantization='gguf' keeps a GGUF file's blocks"):
        _runner(str(_tiny_hf(tmp_path / "hf")), quantization="gguf")


# ---- the embedded model, as a user measures it ------------------------------------------
@pytest.fixture(scope="module")
def heldout_ids() -> list[int]:
    return resolve_model("default").load_tokenizer().encode(HELDOUT.read_text())


@pytest.fixture(scope="module")
def float32_logprobs(heldout_ids) -> torch.Tensor:
    return next_token_logprobs(_runner("default", quantization="none"), heldout_ids, 64)


def test_embedded_gguf_is_served_as_stored_within_1pct_perplexity(heldout_ids, float32_logprobs):
    """The file's blocks as stored, against the same weights dequantized to float32: perplexity
    within 1% through the prefill path (64-token chunks) and the decode path (16-row chunks, the
    GEMV with int8 activations), and at least 90% agreement on the next greedy token."""
    runner = _runner("default")
    assert runner.config.quantization == "gguf"
    assert runner.weight_bytes.quantized == quantized_file_bytes(resolve_model("default").gguf_path)
    reference = perplexity_of(float32_logprobs, heldout_ids)
    assert perplexity(runner, heldout_ids, 64) == pytest.approx(reference, rel=0.01)
    decode_rows = next_token_logprobs(runner, heldout_ids, 16)
    assert perplexity_of(decode_rows, heldout_ids) == pytest.approx(reference, rel=0.01)
    assert top1_agreement(decode_rows, float32_logprobs) >= 0.9


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_embedded_int8_and_fp8_within_3pct_perplexity(heldout_ids, float32_logprobs, method):
    """Through the decode path's GEMV (16-row chunks), as served tokens are."""
    runner = _runner("default", quantization=method)
    assert perplexity(runner, heldout_ids, 16) == pytest.approx(perplexity_of(float32_logprobs, heldout_ids), rel=0.03)


_RSS_PROBE = """
import json, sys
from meshserve import LLM, SamplingParams
from meshserve.layers import cpu_kernels
from meshserve.models.loader import resolve_model
from meshserve.utils.heap import release_free_heap

def rss():
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))

cpu_kernels.available()
resolve_model("default").load_tokenizer()  # the libraries the engine loads, loaded before the baseline
release_free_heap()
before = rss()
llm = LLM(kv_cache_memory_bytes=16 << 20, max_model_len=256)
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
release_free_heap()
kv = sum(c.numel() * c.element_size() for c in llm.engine.executor.runner.kv_caches)
print(json.dumps({"growth": rss() - before, "kv": kv}))
"""


def test_a_gguf_engine_holds_little_more_than_the_file_and_its_kv_cache():
    """What loading and serving the embedded model adds to a process's resident set: at most 1.5x
    the GGUF file plus the KV cache (the interpreter, torch and the tokenizer come before)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _RSS_PROBE], capture_output=True, text=True, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    file_bytes = resolve_model("default").gguf_path.stat().st_size
    assert got["growth"] <= 1.5 * file_bytes + got["kv"], (got, file_bytes)
