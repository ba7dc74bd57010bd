"""The attention backends, each made from the registry and given the same packed step, compute the
same attention: the Triton kernels (run here by the Triton interpreter on CPU tensors), the CPU
backend and the PyTorch reference, on mixed steps (fresh prompts, a prefix hit, a chunk after
earlier chunks and ragged decodes) under grouped-query attention and several block sizes, on a
cache in the compute dtype and on an fp8 one (--kv-cache-dtype, with per-layer scales); decode
split-K equals no split; and the launch geometry always gives tl.dot tiles of at least 16."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: CPU tensors, no GPU

import pytest
import torch

from meshserve.layers import paged_launch
from meshserve.layers.attention import AttentionSpec, KVScales, create_backend
from meshserve.layers.attention.base import UNIT_SCALES
from meshserve.layers.attention.triton_backend import TritonAttentionMetadata
from meshserve.worker.step import SeqStep, StepInput
from meshserve.worker.step_packing import pack_step

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    from meshserve.layers import triton_attention

    assert type(triton_attention._paged_attention_kernel).__name__ == "InterpretedFunction", \
        "TRITON_INTERPRET=1 must be set before the kernels are imported"


def _mixed_step(block_size: int, gen: torch.Generator) -> tuple[StepInput, int]:
    """(new tokens, cached tokens) per sequence: two fresh prompts of one length (the PyTorch path
    batches those), a prefix hit ending on a block boundary, a chunk after an unaligned earlier
    chunk, long enough for several query tiles, and decodes either side of block boundaries."""
    specs = [(7, 0), (7, 0), (9, 2 * block_size), (70, 37)]
    specs += [(1, n - 1) for n in (1, 2, block_size, block_size + 1, 3 * block_size + 2)]
    blocks_needed = [-(-(new + cached) // block_size) for new, cached in specs]
    order = torch.randperm(sum(blocks_needed) + 4, generator=gen).tolist()  # scattered, some unused
    seqs, used = [], 0
    for i, ((new, cached), n) in enumerate(zip(specs, blocks_needed)):
        seqs.append(SeqStep(i, [0] * new, cached, order[used:used + n], sample=True))
        used += n
    return StepInput(seqs), len(order)


def _run_backend(name, packed, spec, q, k, v, cache, scales=UNIT_SCALES):
    """(attention output, cache after the step) of one backend from the registry."""
    backend = create_backend(name, spec, CPU)
    _, _, meta = backend.build_inputs(packed)
    assert type(meta) is backend.metadata_type and meta.backend is backend
    if name == "triton":  # the step must exercise both launches
        assert isinstance(meta, TritonAttentionMetadata)
        assert meta.prefill_launch is not None and meta.decode_block_tables is not None
    cache = cache.clone()
    return backend.forward(q, k, v, cache[0], cache[1], meta, scales), cache


def _run_all(heads, kv_heads, head_dim, block_size, dtype=torch.float32, seed=0, cache_dtype=None,
             scales=UNIT_SCALES):
    """{backend name: (output, cache)} on one mixed step; the references in float32. cache_dtype:
    an fp8 cache (its "cached" tokens the fp8 values nearest to the random ones), else `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    step, num_blocks = _mixed_step(block_size, gen)
    packed = pack_step(step, block_size)
    t = packed.num_tokens
    q = torch.randn(t, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)  # "cached" tokens
    spec = AttentionSpec(heads, kv_heads, block_size)
    if cache_dtype is not None:
        cache = cache.to(cache_dtype)
        fp32 = [x.float() for x in (q, k, v)] + [cache]
    else:
        cache = cache.to(dtype)
        fp32 = [x.float() for x in (q, k, v, cache)]
    return {"torch": _run_backend("torch", packed, spec, *fp32, scales),
            "cpu": _run_backend("cpu", packed, spec, *fp32, scales),
            "triton": _run_backend("triton", packed, spec, q, k, v, cache, scales)}


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (9, 3)])  # GQA groups 1, 4 and 3 (padded to 4)
@pytest.mark.parametrize("block_size", [16, 8, 5])  # 5: keys of one tile span several blocks unevenly
def test_every_backend_computes_the_same_mixed_step(heads, kv_heads, block_size):
    out = _run_all(heads, kv_heads, 32, block_size, seed=heads + block_size)
    expected, ref_cache = out["torch"]
    for name in ("cpu", "triton"):
        got, cache = out[name]
        torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)  # the same K/V written to the same slots
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_head_dim_that_is_not_a_power_of_two():
    out = _run_all(4, 2, 40, 16)
    for name in ("cpu", "triton"):
        torch.testing.assert_close(out[name][0], out["torch"][0], rtol=1e-5, atol=1e-5)


def test_half_precision_cache():
    out = _run_all(8, 2, 32, 16, dtype=torch.float16)
    got = out["triton"][0]
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), out["torch"][0], rtol=0, atol=5e-3)


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("cache_dtype,heads,kv_heads,block_size,dtype", [
    (E4M3, 8, 2, 16, torch.float32), (E5M2, 8, 2, 16, torch.float32), (E4M3, 9, 3, 5, torch.float32),
    (E5M2, 4, 4, 8, torch.float16)])  # the fp8 values widened to a 16-bit query's dtype (the interpreter has no bf16)
def test_every_backend_computes_the_same_step_on_an_fp8_cache(cache_dtype, heads, kv_heads, block_size, dtype):
    scales = KVScales(k=0.5, v=2.0)  # a checkpoint's, say: stored x / scale, read stored x scale
    out = _run_all(heads, kv_heads, 32, block_size, dtype, seed=heads, cache_dtype=cache_dtype, scales=scales)
    expected, ref_cache = out["torch"]
    assert ref_cache.dtype == cache_dtype
    for name in ("cpu", "triton"):
        got, cache = out[name]
        assert cache.dtype == cache_dtype
        assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))  # the same bytes in the same slots
        if name == "cpu" or dtype == torch.float32:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        else:  # Triton's query and output in float16
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), expected, rtol=0, atol=3e-2)
    # The new tokens' K/V are stored as x / scale in fp8: the written slots hold exactly that.
    gen = torch.Generator().manual_seed(heads)
    step, _ = _mixed_step(block_size, gen)
    packed = pack_step(step, block_size)
    torch.randn(packed.num_tokens, heads, 32, generator=gen)  # q, drawn first
    k = torch.randn(packed.num_tokens, kv_heads, 32, generator=gen).to(dtype)
    stored = ref_cache[0].view(-1, kv_heads, 32)[torch.tensor(packed.slot_mapping)]
    assert torch.equal(stored.view(torch.uint8), (k.float() / scales.k).to(cache_dtype).view(torch.uint8))


@pytest.mark.parametrize("num_splits", [1, 4])
def test_e4m3_read_as_bytes_equals_the_native_conversion(num_splits):
    """GPUs before compute capability 8.9 take float8_e4m3fn as bytes turned into float16 patterns."""
    from meshserve.layers import triton_attention

    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, block_size = 8, 2, 32, 16
    lens = [1, 17, 300]
    width = -(-max(lens) // block_size)
    values = torch.randn(2, len(lens) * width, block_size, kv_heads, head_dim, generator=gen) * 100
    values[:, 0, 0, 0, :4] = torch.tensor([2.0 ** -9, -(2.0 ** -8), 448.0, 0.0])  # subnormals, the largest, zero
    cache = values.to(torch.float8_e4m3fn)
    tables = torch.randperm(len(lens) * width, generator=gen).view(len(lens), width)
    tables[0, 0] = 0
    q = torch.randn(len(lens), heads, head_dim, generator=gen) * 0.01
    outs = []
    for bits in (False, True):
        out = torch.full_like(q, float("nan"))
        triton_attention.decode_attention(q, cache[0], cache[1], out, torch.tensor(lens), tables, head_dim ** -0.5,
                                          num_splits, k_scale=0.25, v_scale=3.0, e4m3_bits=bits)
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    # A one-token context attends to its own V row: the stored values times v_scale, exactly.
    torch.testing.assert_close(outs[1][0], (cache[1][0, 0].float() * 3.0).repeat_interleave(heads // kv_heads, 0),
                               rtol=0, atol=0)


def test_decode_split_k_equals_one_range():
    from meshserve.layers import triton_attention

    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, block_size = 8, 2, 32, 16
    lens = [1, 5, 64, 65, 300]  # with 8 splits of 64 keys, most of these leave splits empty
    width = -(-max(lens) // block_size)
    cache = torch.randn(2, len(lens) * width, block_size, kv_heads, head_dim, generator=gen)
    tables = torch.randperm(len(lens) * width, generator=gen).view(len(lens), width)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    outs = []
    for splits in (1, 2, 8):
        out = torch.full_like(q, float("nan"))
        triton_attention.decode_attention(q, cache[0], cache[1], out, torch.tensor(lens), tables,
                                          head_dim ** -0.5, splits)
        outs.append(out)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-5)
    # A one-token context attends to its own V row only.
    torch.testing.assert_close(outs[0][0], cache[1][tables[0, 0], 0].repeat_interleave(heads // kv_heads, 0))


@pytest.mark.parametrize("group", [1, 2, 3, 4, 7, 8, 16])
def test_tiles_fit_tl_dot(group):
    for tile in (paged_launch.prefill_tile(group), paged_launch.decode_tile(group)):
        assert tile.rows >= paged_launch.MIN_DOT and tile.block_n >= paged_launch.MIN_DOT
        assert tile.heads_padded >= group and tile.heads_padded & (tile.heads_padded - 1) == 0
    assert paged_launch.decode_tile(group).block_q == 1


def test_query_tiles_cover_every_token_once():
    lens = [1, 5, 64, 65]
    seqs, starts = paged_launch.query_tiles(lens, 32)
    covered = {(s, t) for s, start in zip(seqs, starts) for t in range(start, min(start + 32, lens[s]))}
    assert covered == {(s, t) for s, n in enumerate(lens) for t in range(n)}
    assert len(seqs) == 1 + 1 + 2 + 3


def test_decode_splits():
    # Large batches already fill the device; small ones split, but never below MIN_KEYS_PER_SPLIT keys.
    assert paged_launch.decode_splits(256, 8) == 1
    assert paged_launch.decode_splits(1, 8) == paged_launch.MAX_DECODE_SPLITS
    assert paged_launch.decode_splits(1, 8, max_context=100) == 1
    assert paged_launch.decode_splits(1, 8, max_context=4 * paged_launch.MIN_KEYS_PER_SPLIT) == 4
    for batch in (1, 3, 17, 64):
        s = paged_launch.decode_splits(batch, 2)
        assert s & (s - 1) == 0 and 1 <= s <= paged_launch.MAX_DECODE_SPLITS
