"""--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2 (vLLM's names): a KV cache of one byte per value.

- Every path reads the fp8 cache as the PyTorch reference does (stored value x the layer's scale):
  the C++ paged decode kernel (AVX-512 and AVX2 paths, each format widened exactly), and the C++
  decoder-layer loop bit for bit against the module path, which writes and reads the same bytes.
  (The Triton kernels, the CPU backend and the PyTorch reference on one mixed step:
  tests/engine/test_triton_attention.py.)
- The same byte budget holds twice the blocks of a bfloat16 cache (4x float32), and the planner
  counts the bytes the engine allocates.
- End to end on the embedded model: greedy continuations mostly agree with the compute-dtype
  cache, prefix caching still hits and reproduces the first answer, and the teacher-forced
  perplexity with chunks that attend to cached fp8 K/V stays within 3%.
"""
from pathlib import Path

import pytest
import torch
from tiny_model import tiny_runner, write_tiny_config

from meshserve.layers import cpu_kernels
from meshserve.layers.attention import KVScales, kv_cache_dtype
from meshserve.layers.attention.base import FP8_KV_DTYPES, FP8_MAX, from_cache, to_cache
from meshserve.layers.attention.torch_ref import gathered_decode
from meshserve.worker.step import SeqStep, StepInput
from meshserve.worker.step_packing import pack_step

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BLOCK = 16
HELDOUT = Path(__file__).parent / "data" / "heldout.txt"


def test_dtype_names_and_the_store_and_read_rule():
    from meshserve.config import KV_CACHE_DTYPES
    from meshserve.models.geometry import FP8_KV_CACHE_DTYPES
    from meshserve.plan.units import KV_DTYPES

    assert ("auto", *FP8_KV_CACHE_DTYPES) == KV_CACHE_DTYPES and set(FP8_KV_CACHE_DTYPES) == set(FP8_KV_DTYPES)
    assert set(KV_CACHE_DTYPES) <= set(KV_DTYPES)  # `meshserve plan` takes every engine value
    assert kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv_cache_dtype("fp8", torch.float32) is E4M3 and kv_cache_dtype("fp8_e4m3", torch.float32) is E4M3
    assert kv_cache_dtype("fp8_e5m2", torch.bfloat16) is E5M2
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_dtype("int8", torch.float32)
    x = torch.tensor([[[1.0, -3.0, 1000.0, -1e9, 1e-3]]])
    for dtype in (E4M3, E5M2):
        stored = to_cache(x, dtype, 0.5)
        assert stored.dtype == dtype
        # x / scale, saturated at the format's largest value (no inf, no NaN)
        expected = (x / 0.5).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
        assert torch.equal(stored.view(torch.uint8), expected.view(torch.uint8))
        assert torch.isfinite(stored.float()).all()
        torch.testing.assert_close(from_cache(stored, torch.float32, 0.5), stored.float() * 0.5)
    assert to_cache(x, torch.float32, 0.5) is x and from_cache(x, torch.float32, 0.5) is x  # auto: untouched


# ---- the C++ paged decode kernel ------------------------------------------------------------------

def _case(lens, heads, kv_heads, head_dim, cache_dtype, scales, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = -(-max(lens) // BLOCK) + 1
    num_blocks = len(lens) * width + 3
    values = torch.randn(2, num_blocks, BLOCK, kv_heads, head_dim, generator=g) * 4
    k_cache, v_cache = to_cache(values[0], cache_dtype, scales.k), to_cache(values[1], cache_dtype, scales.v)
    tables = torch.randperm(num_blocks, generator=g)[:len(lens) * width].view(len(lens), width)
    lens_t = torch.tensor(lens)
    mask = (torch.arange(width * BLOCK)[None, :] < lens_t[:, None])[:, None, None, :]
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    return q, k_cache, v_cache, tables, mask, lens_t


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
# The AVX-512 path's head sizes (64, 128) and one only the AVX2 path takes, with tails (76).
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64), (8, 2, 76)])
def test_paged_decode_reads_the_fp8_cache_as_the_reference(cache_dtype, q_dtype, heads, kv_heads, head_dim, isa):
    scales = KVScales(k=0.25, v=3.0)
    lens = [1, 2, 15, 16, 17, 100, 321]
    q, k_cache, v_cache, tables, mask, lens_t = _case(lens, heads, kv_heads, head_dim, cache_dtype, scales,
                                                      seed=heads + head_dim)
    q = q.to(q_dtype)
    assert cpu_kernels.decode_usable(q, k_cache)
    expected = gathered_decode(q.float(), k_cache, v_cache, tables, mask, scales)
    got = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens_t, head_dim ** -0.5, *scales)
    assert got.dtype == q_dtype and got.shape == expected.shape
    if q_dtype == torch.float32:  # outputs up to ~12 (values ~4 x v_scale 3)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    else:  # float32 attention of the bf16 query, rounded once to bf16
        spacing = expected.abs().clamp_min(1e-3) * 2.0 ** -7
        assert ((got.float() - expected).abs() / spacing).max().item() <= 1.0


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("head_dim", [128, 76])  # the AVX-512 path (at isa=avx512) and the AVX2 one
def test_every_fp8_value_is_widened_exactly(cache_dtype, head_dim, isa):
    """A one-token context's output is its V row times v_scale: every finite byte of the format,
    subnormals and the largest values included, comes out as the float the reference reads."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(cache_dtype).float()
    codes = codes[torch.isfinite(values)]
    kv_heads = -(-len(codes) // head_dim)
    row = torch.zeros(kv_heads * head_dim, dtype=torch.uint8)
    row[:len(codes)] = codes
    v_cache = row.view(cache_dtype).view(1, 1, kv_heads, head_dim).expand(2, BLOCK, -1, -1).contiguous()
    k_cache = torch.zeros_like(v_cache)
    q = torch.randn(1, kv_heads, head_dim)
    got = cpu_kernels.paged_decode(q, k_cache, v_cache, torch.tensor([[1, 0]]), torch.tensor([1]), 0.125, 1.0, 2.0)
    assert torch.equal(got[0], v_cache[1, 0].float() * 2.0)


def test_a_compute_dtype_cache_ignores_the_scales():
    scales = KVScales(k=0.25, v=3.0)
    q, k_cache, v_cache, tables, mask, lens = _case([5, 40], 9, 3, 64, torch.float32, KVScales())
    plain = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, 0.125)
    assert torch.equal(cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, 0.125, *scales), plain)
    assert torch.equal(gathered_decode(q, k_cache, v_cache, tables, mask, scales),
                       gathered_decode(q, k_cache, v_cache, tables, mask))
    assert not cpu_kernels.decode_usable(q.double(), k_cache.double())
    assert not cpu_kernels.decode_usable(q, k_cache.bfloat16())  # a 16-bit cache takes q's dtype


# ---- the C++ decoder-layer loop -------------------------------------------------------------------

def _steps() -> list[StepInput]:
    """Fresh prompts (two of one length), a chunk after cached tokens beside decodes, decodes."""
    toks = lambda n, base: [(base + 7 * i) % 100 + 1 for i in range(n)]  # noqa: E731
    t = {0: [0, 1], 1: [2, 3], 2: [4, 5]}
    return [
        StepInput([SeqStep(0, toks(12, 1), 0, t[0], True), SeqStep(1, toks(12, 2), 0, t[1], True),
                   SeqStep(2, toks(7, 3), 0, t[2], False)]),
        StepInput([SeqStep(2, toks(6, 4), 7, t[2], True), SeqStep(0, [5], 12, t[0], True),
                   SeqStep(1, [6], 12, t[1], True)]),
        StepInput([SeqStep(0, [10], 13, t[0], True), SeqStep(1, [11], 13, t[1], True)]),
    ]


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoder_loop_on_an_fp8_cache_equals_the_module_path_bit_for_bit(tmp_path, kv, dtype):
    runner = tiny_runner(tmp_path, block_size=8, dtype=dtype, kv_cache_dtype=kv)
    model, stack = runner.model, runner.model.cpu_stack
    assert stack is not None and runner.kv_dtype == kv_cache_dtype(kv, runner.dtype)
    for i, layer in enumerate(model.decoder_layers()):  # as a checkpoint's k_scale / v_scale would set them
        layer.self_attn.attn.kv_scales = KVScales(k=0.5 + i, v=0.25 * (i + 1))
    fast = [torch.zeros(2, 8, 8, runner.num_kv_heads, runner.head_dim, dtype=runner.kv_dtype)
            for _ in model.layers]
    plain = [c.clone() for c in fast]
    with torch.inference_mode():
        for step in _steps():
            ids, positions, meta = runner.attn_backend.build_inputs(pack_step(step, 8))
            assert stack.accepts(model.embed_tokens(ids), fast, meta)
            model.cpu_stack = stack
            out_fast = model(ids, positions, fast, meta)
            model.cpu_stack = None
            out_plain = model(ids, positions, plain, meta)
            assert torch.equal(out_fast, out_plain)
            for a, b in zip(fast, plain):
                assert a.dtype == runner.kv_dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert out_fast.abs().sum() > 0 and fast[0].view(torch.uint8).any()


def test_checkpoint_kv_scales_reach_the_layers(tmp_path):
    runner = tiny_runner(tmp_path, kv_cache_dtype="fp8")
    model = runner.model
    model.load_weights([("model.layers.0.self_attn.k_scale", torch.tensor(0.5)),
                        ("model.layers.0.self_attn.v_proj.output_scale", torch.tensor([0.75])),
                        ("model.layers.1.self_attn.kv_scale", torch.tensor(2.0))])
    layers = model.decoder_layers()
    assert layers[0].self_attn.attn.kv_scales == KVScales(k=0.5, v=0.75)
    assert layers[1].self_attn.attn.kv_scales == KVScales(k=2.0, v=2.0)
    with pytest.raises(ValueError, match="positive and finite"):
        model.load_weights([("model.layers.0.self_attn.k_scale", torch.tensor(0.0))])


# ---- blocks and bytes -----------------------------------------------------------------------------

def test_the_same_budget_holds_twice_the_blocks_of_bf16_and_4x_float32(tmp_path):
    blocks, block_bytes = {}, {}
    for dtype, kv in (("bfloat16", "auto"), ("float32", "auto"), ("bfloat16", "fp8"), ("float32", "fp8_e5m2")):
        runner = tiny_runner(tmp_path, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_bytes=1 << 20)
        blocks[dtype, kv], block_bytes[dtype, kv] = runner.num_kv_blocks(), runner.block_bytes
        runner.init_kv_cache(4)
        assert all(c.dtype == runner.kv_dtype for c in runner.kv_caches)
        assert sum(c.element_size() * c.numel() for c in runner.kv_caches) == 4 * runner.block_bytes
    assert block_bytes["bfloat16", "fp8"] * 2 == block_bytes["bfloat16", "auto"]
    assert blocks["bfloat16", "fp8"] == 2 * blocks["bfloat16", "auto"]
    assert blocks["float32", "fp8_e5m2"] == 4 * blocks["float32", "auto"] == blocks["bfloat16", "fp8"]


def test_the_planner_counts_the_bytes_the_engine_allocates(tmp_path):
    from meshserve.models.loader import resolve_model
    from meshserve.plan.catalog import get_model, spec_from_model_config
    from meshserve.plan.memory import kv_bytes_per_token

    tiny = tiny_runner(tmp_path, dtype="bfloat16", kv_cache_dtype="fp8")
    tiny_spec = get_model(str(write_tiny_config(tmp_path)))
    embedded = resolve_model("default").config
    for spec, runner_of in ((tiny_spec, lambda kv: tiny if kv == "fp8" else tiny_runner(tmp_path, kv_cache_dtype=kv)),
                            (spec_from_model_config(embedded, "default"), None)):
        for kv in ("fp8", "fp8_e4m3", "fp8_e5m2"):
            per_token = kv_bytes_per_token(spec, kv)
            assert per_token == spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim  # one byte per value
            if runner_of is not None:
                runner = runner_of(kv)
                assert per_token == runner.block_bytes / runner.block_size
    # the catalog's entry for the embedded model agrees with its config.json
    assert kv_bytes_per_token(get_model("SmolLM2-135M"), "fp8") == kv_bytes_per_token(
        spec_from_model_config(embedded, "default"), "fp8")


# ---- end to end on the embedded model --------------------------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
           "Once upon a time, in a small village,", HELDOUT.read_text()[:300]]  # the last: several full blocks
BUDGET = 32 << 20


@pytest.fixture(scope="module")
def greedy_runs():
    """{kv_cache_dtype: (outputs, the last prompt's output again, KV blocks, block bytes)} of
    `LLM()` (the embedded model, float32 on CPU) with 32-token greedy continuations. Its weights
    dequantized (quantization none): every path then computes in float32, so that what differs is
    the KV cache alone."""
    from meshserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    runs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(kv_cache_dtype=kv, quantization="none", dtype="float32", max_model_len=256,
                  kv_cache_memory_bytes=BUDGET)
        try:
            outs = llm.generate(PROMPTS, params)
            again = llm.generate(PROMPTS[-1:], params)[0]  # its prompt's full blocks are cached now
            runs[kv] = (outs, again, llm.engine.block_manager.num_blocks, llm.engine.executor.block_bytes())
        finally:
            llm.engine.shutdown()
    return runs


@pytest.fixture(scope="module")
def teacher_forced(greedy_runs):
    """{kv_cache_dtype: (greedy agreement per prompt, perplexity)} of the embedded model: how often
    its most likely next token is the `auto` engine's greedy choice given the same prefix (the
    continuations above, in 16-token chunks), and its perplexity on a held-out text in 32-token
    chunks; in both, every chunk after the first attends to the K/V the earlier ones cached."""
    from meshserve.config import EngineConfig
    from meshserve.eval.perplexity import greedy_agreement, load_runner, perplexity
    from meshserve.models.loader import resolve_model

    ids = resolve_model("default").load_tokenizer().encode(HELDOUT.read_text())
    texts = [(o.prompt_token_ids + o.outputs[0].token_ids, len(o.prompt_token_ids)) for o in greedy_runs["auto"][0]]
    scores = {}
    for kv in ("auto", "fp8", "fp8_e5m2"):
        runner = load_runner(EngineConfig(device="cpu", kv_cache_dtype=kv, quantization="none", dtype="float32"),
                             len(ids))
        assert runner.kv_dtype == kv_cache_dtype(kv, runner.dtype)
        scores[kv] = ([greedy_agreement(runner, text, start, 16) for text, start in texts],
                      perplexity(runner, ids, chunk_tokens=32))
    return scores


# Measured: auto 1.0 (the runner's chunks pick what the engine's steps picked), fp8 0.95, fp8_e5m2 0.925.
@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_embedded_model_greedy_agrees_with_the_compute_dtype_cache(teacher_forced, kv):
    agreement = teacher_forced[kv][0]
    assert sum(agreement) / len(agreement) >= 0.8, agreement


# Measured on the held-out text: auto 25.29, fp8 25.45 (+0.6%), fp8_e5m2 25.85 (+2.2%).
@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_embedded_model_perplexity_within_3pct_of_the_compute_dtype_cache(teacher_forced, kv):
    assert teacher_forced[kv][1] == pytest.approx(teacher_forced["auto"][1], rel=0.03)


def test_embedded_model_prefix_hits_on_the_fp8_cache(greedy_runs):
    outs, again, blocks, block_bytes = greedy_runs["fp8"]
    assert again.metrics.num_cached_prompt_tokens >= 3 * 16
    # the cached fp8 K/V are what the first request attended to: the same continuation
    assert again.outputs[0].token_ids == outs[-1].outputs[0].token_ids
    auto_blocks, auto_bytes = greedy_runs["auto"][2:]
    # a quarter of the float32 cache's bytes per block (float32 compute on CPU): 4x the blocks
    assert block_bytes * 4 == auto_bytes
    assert blocks == BUDGET // block_bytes and auto_blocks == BUDGET // auto_bytes == blocks // 4

