"""The CPU kernels (paged decode attention, fused RMSNorm, SiLU-and-multiply, rotary) and the
pre-packed small-batch matmuls equal their PyTorch formulas; the callers (the CPU attention
backend among them, against the PyTorch reference backend) fall back to PyTorch when the kernels
are disabled, unavailable or given tensors they do not handle; and an engine with all of them on
generates what one with all of them off generates."""
import contextlib
import fcntl
import logging
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshserve.layers import cpu_kernels
from meshserve.layers.attention import AttentionSpec, create_backend
from meshserve.layers.attention.torch_ref import gathered_decode
from meshserve.utils.cpuinfo import cpu_flags, cpu_vendor, onednn_packs_bf16
from meshserve.worker.step_packing import PackedStep, PrefillSpan

BLOCK = 16
HEAD_DIM = 64
CPU = torch.device("cpu")


def _case(lens, heads, kv_heads, table_kind, seed=0, head_dim=HEAD_DIM, block=BLOCK):
    g = torch.Generator().manual_seed(seed)
    width = -(-max(lens) // block) + 1  # one spare column: tables are padded past the longest sequence
    num_blocks = len(lens) * width + 3
    k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g)
    if table_kind == "scattered":
        tables = torch.randperm(num_blocks, generator=g)[:len(lens) * width].view(len(lens), width)
    elif table_kind == "shared_prefix":  # every sequence starts with the same two blocks, as after a prefix hit
        tables = torch.randperm(num_blocks, generator=g)[:len(lens) * width].view(len(lens), width)
        tables[:, :2] = tables[0, :2]
    else:  # "padded": blocks past each sequence's length are 0, as the model runner pads them
        tables = torch.arange(len(lens) * width).view(len(lens), width)
        for i, n in enumerate(lens):
            tables[i, -(-n // block):] = 0
    lens_t = torch.tensor(lens)
    mask = (torch.arange(width * block)[None, :] < lens_t[:, None])[:, None, None, :]
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    return q, k_cache, v_cache, tables, mask, lens_t


def _decode_through(name, q, k_cache, v_cache, tables, lens, table_dtype=torch.long):
    """The decode step of these sequences through one attention backend from the registry. Each new
    token's K/V is what the cache already holds at its slot, so the write leaves the cache as it is."""
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    rows = [t[:-(-n // BLOCK)] for t, n in zip(tables.tolist(), lens.tolist())]
    slots = [t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(rows, lens.tolist())]
    packed = PackedStep(input_ids=[0] * len(rows), positions=[n - 1 for n in lens.tolist()], slot_mapping=slots,
                        decode_context_lens=lens.tolist(), decode_block_tables=rows)
    backend = create_backend(name, AttentionSpec(q.shape[1], kvh, BLOCK), CPU)
    _, _, meta = backend.build_inputs(packed)
    meta.decode_block_tables = meta.decode_block_tables.to(table_dtype)
    k, v = k_cache.view(-1, kvh, d)[slots], v_cache.view(-1, kvh, d)[slots]
    return backend.forward(q, k, v, k_cache, v_cache, meta)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_kernels.available(), "the C++ kernel must build here (g++ and ninja are installed)"


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2)])  # GQA ratios 1, 3 and 4
@pytest.mark.parametrize("table_kind", ["scattered", "shared_prefix", "padded"])
# The two compiled-in sizes (AVX-512: sixteen keys at a time; AVX2: eight), and run-time ones with
# a tail past the 16-column value chunks (72) and past the 8-wide key dot products too (76).
@pytest.mark.parametrize("head_dim", [64, 128, 72, 76])
def test_kernel_equals_pytorch_path(heads, kv_heads, table_kind, head_dim, isa):
    lens = [1, 2, 15, 16, 17, 32, 33, 47, 100, 321]  # single token, either side of block boundaries, long
    q, k_cache, v_cache, tables, mask, lens_t = _case(lens, heads, kv_heads, table_kind, heads + kv_heads, head_dim)
    expected = gathered_decode(q, k_cache, v_cache, tables, mask)
    got = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens_t, head_dim ** -0.5)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-5
    # A single-token context attends to exactly its own V row.
    first_block = tables[0, 0]
    torch.testing.assert_close(got[0], v_cache[first_block, 0].repeat_interleave(heads // kv_heads, dim=0))


def test_cpu_backend_decodes_with_the_kernel_and_accepts_strided_inputs(monkeypatch):
    q, k_cache, v_cache, tables, _, lens = _case([5, 40, 200], 9, 3, "scattered")
    expected = _decode_through("torch", q, k_cache, v_cache, tables, lens)
    calls = []
    real = cpu_kernels.paged_decode
    monkeypatch.setattr(cpu_kernels, "paged_decode", lambda *a: calls.append(1) or real(*a))
    wide = torch.cat([torch.zeros_like(q), q], dim=-1)[..., HEAD_DIM:]  # non-contiguous view, as after a split
    got = _decode_through("cpu", wide, k_cache, v_cache, tables, lens, table_dtype=torch.int32)
    assert calls == [1]
    assert (got - expected).abs().max().item() < 1e-5


def test_env_var_forces_pytorch_path(monkeypatch):
    q, k_cache, v_cache, tables, _, lens = _case([3, 30], 9, 3, "padded")
    monkeypatch.setenv("MESHSERVE_DISABLE_CPU_KERNELS", "1")
    monkeypatch.setattr(cpu_kernels, "paged_decode", lambda *a: pytest.fail("kernel used while disabled"))
    assert not cpu_kernels.usable(q, k_cache)
    torch.testing.assert_close(_decode_through("cpu", q, k_cache, v_cache, tables, lens),
                               _decode_through("torch", q, k_cache, v_cache, tables, lens))


def test_other_dtypes_keep_pytorch_path():
    q, k_cache, *_ = _case([3], 9, 3, "padded")
    assert cpu_kernels.usable(q, k_cache)
    assert cpu_kernels.usable(q.bfloat16(), k_cache.bfloat16())
    assert not cpu_kernels.usable(q.double(), k_cache.double())
    assert not cpu_kernels.usable(q.half(), k_cache.half())
    assert not cpu_kernels.usable(q, k_cache.bfloat16())  # one dtype for all of a kernel's tensors


# ---- causal attention of fresh prompts (float32, AVX2 CPUs without AVX-512) ---------------------------

def _split_qkv(n, length, heads, kv_heads, head_dim, seed=0, own_k=False, dtype=torch.float32):
    """q, k, v as the model has them: column slices of one QKV output, so their rows are strided;
    with own_k, k in a tensor of its own (Qwen3 norms q and k into new tensors), so that k's rows and
    v's have different strides."""
    g = torch.Generator().manual_seed(seed)
    qkv = (3 * torch.randn(n * length, (heads + 2 * kv_heads) * head_dim, generator=g)).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    if own_k:
        k = k.contiguous()
    return (q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim))


def _causal_sdpa(q, k, v, n):
    def heads_first(x):
        return x.reshape(n, -1, *x.shape[1:]).transpose(1, 2)
    o = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), is_causal=True,
                                       enable_gqa=True)
    return o.transpose(1, 2).reshape(q.shape)


def _intel_avx512_taken(isa: str) -> bool:
    """PyTorch's SDPA keeps float32 prompts there (the kernel was not measured against its AVX-512 path)."""
    return (isa == "avx512" and {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags()
            and cpu_vendor() == "GenuineIntel")


def test_prefill_kernel_runs_but_on_intel_avx512(isa):
    q = torch.zeros(2 * 2048, 1, 64)  # two prompts of the longest length it takes
    assert cpu_kernels.prefill_usable(q, 2) == (not _intel_avx512_taken(isa))
    assert not cpu_kernels.prefill_usable(q, 1)  # one prompt of 4,096: PyTorch's kernel is faster there
    assert not cpu_kernels.prefill_usable(torch.zeros(1, 1, 60), 1)  # head size not a multiple of 8
    assert not cpu_kernels.prefill_usable(q.half(), 2)


def test_bf16_prefill_kernel_runs_on_amx_alone(bf16_path):
    q = torch.zeros(2 * 2048, 1, 64, dtype=torch.bfloat16)
    amx = bf16_path == "amx"
    assert cpu_kernels.prefill_usable(q, 2) == amx
    assert not cpu_kernels.prefill_usable(q, 1)  # one prompt of 4,096
    for head_dim in (32, 96, 128):
        assert cpu_kernels.prefill_usable(q[:, :, :1].expand(-1, -1, head_dim), 2) == amx
    for head_dim in (16, 48, 160):  # whole 32-value tiles, at most four of them
        assert not cpu_kernels.prefill_usable(torch.zeros(8, 1, head_dim, dtype=torch.bfloat16), 1)


# Prompt lengths either side of the kernel's tiles (six positions, sixteen keys), group sizes 1-4,
# head sizes through the 32-column and the 8-column weighted sums.
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 3), length=st.integers(1, 70), kv_heads=st.integers(1, 3), group=st.integers(1, 4),
       head_dim=st.sampled_from([8, 32, 40, 64, 128]), seed=st.integers(0, 3), own_k=st.booleans())
def test_prefill_causal_is_causal_attention(n, length, kv_heads, group, head_dim, seed, own_k):
    cpu_kernels.allow_avx512(False)  # on an Intel CPU with AVX-512 the kernel is only taken so
    try:
        q, k, v = _split_qkv(n, length, kv_heads * group, kv_heads, head_dim, seed, own_k)
        got = cpu_kernels.prefill_causal(q, k, v, n)
    finally:
        cpu_kernels.allow_avx512(True)
    # Each output is a float32 sum whose terms reach the largest value: its rounding, and SDPA's,
    # scale with that value, not with the (possibly small) output.
    torch.testing.assert_close(got, _causal_sdpa(q, k, v, n), rtol=1e-4, atol=1e-5 * v.abs().max().item())
    # The first position of each prompt attends to its own value row alone.
    first = torch.arange(n) * length
    torch.testing.assert_close(got[first], v[first].repeat_interleave(group, dim=1), rtol=1e-5, atol=1e-6)


def test_prefill_causal_refuses_what_it_cannot_compute():
    q, k, v = _split_qkv(2, 5, 9, 3, 64)
    previous = cpu_kernels.allow_avx512(False)  # on Intel with AVX-512 it refuses every call
    try:
        with pytest.raises(RuntimeError, match="equal length"):
            cpu_kernels.prefill_causal(q, k, v, 3)
        with pytest.raises(RuntimeError, match="all float32 or all bfloat16"):
            cpu_kernels.prefill_causal(q.bfloat16(), k, v, 2)
        with pytest.raises(RuntimeError, match="all float32 or all bfloat16"):
            cpu_kernels.prefill_causal(q.half(), k.half(), v.half(), 2)
        with pytest.raises(RuntimeError, match="multiple of kv_heads"):
            cpu_kernels.prefill_causal(q[:, :8], k, v, 2)
    finally:
        cpu_kernels.allow_avx512(previous)
    if _intel_avx512_taken("avx512"):
        with pytest.raises(RuntimeError, match="not for this CPU"):
            cpu_kernels.prefill_causal(q, k, v, 2)
    previous = cpu_kernels.allow_amx(False)
    try:
        with pytest.raises(RuntimeError, match="not for this CPU"):
            cpu_kernels.prefill_causal(q.bfloat16(), k.bfloat16(), v.bfloat16(), 2)
    finally:
        cpu_kernels.allow_amx(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_prefills_fresh_prompts_with_the_kernel(dtype, monkeypatch):
    if dtype == torch.bfloat16:
        _needs_amx()
    # float32: where the CPU has AVX-512 the kernel is only taken so; bfloat16 takes it on AMX
    cpu_kernels.allow_avx512(dtype == torch.bfloat16)
    try:
        q, k, v = (x.to(dtype) for x in _split_qkv(2, 40, 9, 3, HEAD_DIM))
        spans = [PrefillSpan(0, 40, 0, [0, 1, 2]), PrefillSpan(40, 80, 0, [3, 4, 5])]
        packed = PackedStep(input_ids=[0] * 80, positions=list(range(40)) * 2, slot_mapping=list(range(80)),
                            prefills=spans)
        k_cache = torch.zeros(8, BLOCK, 3, HEAD_DIM, dtype=dtype)
        calls = []
        real = cpu_kernels.prefill_causal
        monkeypatch.setattr(cpu_kernels, "prefill_causal", lambda *a: calls.append(a[3]) or real(*a))
        outs = {}
        for name in ("torch", "cpu"):
            backend = create_backend(name, AttentionSpec(9, 3, BLOCK), CPU)
            _, _, meta = backend.build_inputs(packed)
            outs[name] = backend.forward(q, k, v, k_cache.clone(), k_cache.clone(), meta)
        assert calls == [2]  # the CPU backend's, both prompts in one call
    finally:
        cpu_kernels.allow_avx512(True)
    if dtype == torch.float32:
        torch.testing.assert_close(outs["cpu"], outs["torch"], rtol=1e-4, atol=2e-5)
    else:  # PyTorch's kernel and this one each round the probabilities to bfloat16
        torch.testing.assert_close(outs["cpu"], outs["torch"], rtol=2 ** -6, atol=2 ** -6)


# ---- bfloat16: read into float32, computed in float32, rounded once when stored ---------------------

def _bf16_ulps(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest difference in units of bfloat16's spacing at the expected value (2^-7 relative)."""
    assert got.dtype == torch.bfloat16
    spacing = expected.float().abs().clamp_min(1e-3) * 2.0 ** -7
    return ((got.float() - expected.float()).abs() / spacing).max().item()


@pytest.fixture(params=["avx2", "avx512_bf16", "amx"])
def bf16_path(request):
    """bfloat16 attention's paths: AVX2, AVX512-BF16 (vdpbf16ps and lane sums), and AMX tiles (where
    this CPU has them: decode attention's scores, prompt attention)."""
    if request.param == "amx" and cpu_kernels.panel_bf16_isa() != "amx":
        pytest.skip("no AMX-BF16 here (or the OS does not give this process the tile registers)")
    previous = cpu_kernels.allow_avx512(request.param != "avx2"), cpu_kernels.allow_amx(request.param == "amx")
    yield request.param
    cpu_kernels.allow_avx512(previous[0])
    cpu_kernels.allow_amx(previous[1])


def _needs_amx():
    if cpu_kernels.panel_bf16_isa() != "amx":
        pytest.skip("no AMX-BF16 here (or the OS does not give this process the tile registers)")


# Prompt lengths either side of the tiles (16 positions and keys for the scores, 32 keys for the
# weighted values), groups of 1-5 heads, every head size the AMX kernel takes (1-4 tiles of 32).
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3), length=st.one_of(st.integers(1, 70), st.sampled_from([255, 256, 257])),
       kv_heads=st.integers(1, 3), group=st.integers(1, 5), head_dim=st.sampled_from([32, 64, 96, 128]),
       seed=st.integers(0, 3), own_k=st.booleans())
def test_bf16_prefill_is_causal_attention_of_the_bf16_values(n, length, kv_heads, group, head_dim, seed, own_k):
    _needs_amx()
    q, k, v = _split_qkv(n, length, kv_heads * group, kv_heads, head_dim, seed, own_k, torch.bfloat16)
    got = cpu_kernels.prefill_causal(q, k, v, n)
    expected = _causal_sdpa(q.float(), k.float(), v.float(), n)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    # The probabilities are rounded to bfloat16 before they weigh the values (as PyTorch's kernel
    # rounds them), each within 2^-9 of itself: an output moves by at most 2^-9 of the largest
    # value, then takes its own rounding.
    bound = 2.0 ** -8 * (v.float().abs().max() + expected.abs())
    assert ((got.float() - expected).abs() <= bound).all()
    # The first position of each prompt attends to its own value row alone: exactly that row.
    first = torch.arange(n) * length
    assert torch.equal(got[first], v[first].repeat_interleave(group, dim=1))


# Group sizes 1, 3, 4 and 8 (the AVX512-BF16 path takes up to four heads of a group at a time at
# head size 64, two at 128), a head size only the AVX2 path takes (76); for the AMX scores, which
# take heads in sets of whole groups of at most 16 columns: 32 heads (two sets of 16), groups of 7
# (sets of 14), of 16 (one set) and of 20 (more than a tile: the vector path); blocks of 32 keys
# (two tiles a block) and of 8 (less than a tile: the vector path).
@pytest.mark.parametrize("heads,kv_heads,head_dim,block", [
    (9, 3, 64, 16), (4, 4, 64, 16), (16, 2, 64, 16), (8, 2, 128, 16), (4, 4, 76, 16), (32, 8, 64, 16),
    (28, 4, 128, 16), (16, 1, 64, 16), (20, 1, 64, 16), (9, 3, 64, 32), (9, 3, 64, 8)])
def test_bf16_paged_decode_is_the_float32_attention_of_the_bf16_values(heads, kv_heads, head_dim, block, bf16_path):
    lens = [1, 15, 16, 17, 100, 321]
    q, k_cache, v_cache, tables, mask, lens_t = _case(lens, heads, kv_heads, "scattered", 5, head_dim, block)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    expected = gathered_decode(q.float(), k_cache.float(), v_cache.float(), tables, mask)
    got = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens_t, head_dim ** -0.5)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    assert _bf16_ulps(got, expected) <= 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torchs_on_ties_infinities_and_nans(dtype, isa):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 1000, generator=g).to(dtype)
    x[1, [10, 500]] = 9.0  # a tie: the first wins (in different vector lanes: 10 and 500 % 16)
    x[7, [33, 17, 999]] = 9.0  # a tie within one lane (17 and 33), and one in the row's partial last vector
    x[2] = float("-inf")  # all -inf: index 0
    x[3, 700] = float("inf")
    x[4, [20, 900]] = float("nan")  # the first NaN, even after larger values
    x[4, 5] = 100.0
    x[5] = x[5].round()  # many ties among small integers
    x[6, -1] = 50.0  # the last element
    got = cpu_kernels.argmax(x)
    assert got.dtype == torch.long
    assert torch.equal(got, x.argmax(dim=-1))
    assert got[4] == 20 and got[1] == 10 and got[7] == 17


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 15, 16, 17, 49152])
def test_argmax_of_rows_of_any_width_with_many_ties(dtype, width, isa):
    g = torch.Generator().manual_seed(width)
    x = torch.randint(-3, 4, (6, width), generator=g).to(dtype)  # few values: ties in every row
    x[1] = float("-inf")
    x[2, -1] = 10.0
    assert torch.equal(cpu_kernels.argmax(x), x.argmax(dim=-1))
    assert torch.equal(cpu_kernels.argmax(x[:, : max(1, width // 2)]), x[:, : max(1, width // 2)].argmax(dim=-1))


@pytest.mark.parametrize("rows", [1, 15, 16, 31, 32, 33, 100, 257])
def test_row_kernels_compute_every_row_on_any_thread_count(rows):
    """RMSNorm, SiLU-and-multiply, rotary and argmax hand their rows to the threads in chunks taken
    as the threads finish: for any row count around the chunk sizes and any thread count, every
    row is computed, bit for bit as on one thread."""
    g = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 576, generator=g).bfloat16(), torch.randn(rows, 576, generator=g).bfloat16()
    w, gate_up = torch.randn(576, generator=g).bfloat16(), torch.randn(rows, 2 * 200, generator=g).bfloat16()
    qkv, positions = torch.randn(rows, 15 * 64, generator=g).bfloat16(), torch.randint(0, 512, (rows,), generator=g)
    from meshserve.layers.rotary import RotaryEmbedding
    rot = RotaryEmbedding(64, 512, 10000.0, None)

    def results():
        stream, rotated = residual.clone(), qkv.clone()
        normed = cpu_kernels.rms_norm(x, w, 1e-5, stream)
        cpu_kernels.rotary_(rotated, positions, rot.cos, rot.sin, 12, 64)
        return normed, stream, cpu_kernels.silu_and_mul(gate_up), rotated, cpu_kernels.argmax(gate_up)

    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = results()
        for threads in (2, 3):
            torch.set_num_threads(threads)
            for got, expected in zip(results(), alone):
                assert torch.equal(got, expected), threads
    finally:
        torch.set_num_threads(previous)


def test_bf16_elementwise_kernels_round_float32_math_once(isa):
    g = torch.Generator().manual_seed(7)
    x, residual = torch.randn(37, 576, generator=g).bfloat16(), torch.randn(37, 576, generator=g).bfloat16()
    w = torch.randn(576, generator=g).bfloat16()
    summed = (x.float() + residual.float()).bfloat16()  # the stream is stored in bfloat16
    normed = (summed.float() * torch.rsqrt(summed.float().pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    stream = residual.clone()
    out = cpu_kernels.rms_norm(x, w, 1e-5, stream)
    assert torch.equal(stream, summed)
    assert _bf16_ulps(out, w.float() * normed.float()) <= 0.5 + 1e-3

    gate_up = (torch.randn(9, 2 * 200, generator=g) * 6).bfloat16()
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert _bf16_ulps(cpu_kernels.silu_and_mul(gate_up), F.silu(gate) * up) <= 0.5 + 1e-3
    gate_up[0, :6] = torch.tensor([-200.0, -88.0, -20.0, 0.0, 20.0, 100.0])  # the exponential's clamps and beyond
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_and_mul(gate_up).float(), F.silu(gate) * up, rtol=2 ** -8, atol=1e-6)

    from meshserve.layers.rotary import RotaryEmbedding
    rot = RotaryEmbedding(64, 512, 10000.0, None)
    qkv = torch.randn(5, 15 * 64, generator=g).bfloat16()
    positions = torch.tensor([0, 1, 77, 300, 511])
    q, k, _ = qkv.float().split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q_ref, k_ref = rot(positions, q.reshape(5, 9, 64), k.reshape(5, 3, 64))  # float32 tables and math
    q2, k2, _ = rot.apply_qkv(positions, qkv, 9, 3)
    assert _bf16_ulps(q2, q_ref) <= 0.5 + 1e-3 and _bf16_ulps(k2, k_ref) <= 0.5 + 1e-3

    nan = torch.tensor([[float("nan"), 1.0]], dtype=torch.bfloat16)
    assert torch.isnan(cpu_kernels.silu_and_mul(torch.cat([nan, nan], 1))[0, 0])


def test_failed_build_warns_once_and_falls_back(monkeypatch, caplog):
    def no_compiler():
        raise RuntimeError("Error building extension\nc++: command not found")

    monkeypatch.setattr(cpu_kernels, "_build", no_compiler)
    monkeypatch.setattr(cpu_kernels, "_module", None)
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    q, k_cache, v_cache, tables, _, lens = _case([3, 30], 9, 3, "padded")
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        out = _decode_through("cpu", q, k_cache, v_cache, tables, lens)
        _decode_through("cpu", q, k_cache, v_cache, tables, lens)
    torch.testing.assert_close(out, _decode_through("torch", q, k_cache, v_cache, tables, lens))
    warnings = [r for r in caplog.records if r.name == cpu_kernels.__name__]
    assert len(warnings) == 1 and "command not found" in warnings[0].getMessage()


def test_a_killed_build_leaves_nothing_that_blocks_the_next_one(tmp_path):
    """A build holds the lock while it runs; killed midway, it leaves torch's lock file behind, and
    the next build takes the lock and clears that file instead of waiting on it forever."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, pathlib\n"
         "from meshserve.layers.cpu_kernels import _build_lock\n"
         "with _build_lock(pathlib.Path(sys.argv[1])):\n"
         "    (pathlib.Path(sys.argv[1]) / 'lock').touch()\n"  # torch's, as a build in progress has it
         "    print('held', flush=True)\n"
         "    sys.stdin.read()\n", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with open(tmp_path / "build.flock") as f, pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        holder.kill()
        holder.wait(timeout=60)
    assert (tmp_path / "lock").exists()
    with cpu_kernels._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_out_of_range_inputs_raise_instead_of_reading_past_the_cache():
    q, k_cache, v_cache, tables, _, lens = _case([20], 9, 3, "padded")
    too_long = torch.tensor([tables.shape[1] * BLOCK + 1])
    with pytest.raises(RuntimeError, match="context length"):
        cpu_kernels.paged_decode(q, k_cache, v_cache, tables, too_long, 0.125)
    bad_table = tables.clone()
    bad_table[0, 1] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="block id"):
        cpu_kernels.paged_decode(q, k_cache, v_cache, bad_table, lens, 0.125)


# ---- fused element-wise kernels ------------------------------------------------------------------

def _rms_ref(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rms_norm_with_and_without_residual(rows, isa):
    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 2 * 576, generator=g)
    x = wide[:, 100:676]  # rows with a stride, as a slice of a larger output
    w, residual = torch.randn(576, generator=g), torch.randn(rows, 576, generator=g)
    torch.testing.assert_close(cpu_kernels.rms_norm(x, w, 1e-5), _rms_ref(x, w, 1e-5))
    expected_sum = x + residual
    out = cpu_kernels.rms_norm(x, w, 1e-5, residual)
    torch.testing.assert_close(residual, expected_sum, rtol=0, atol=0)  # the stream is updated in place
    torch.testing.assert_close(out, _rms_ref(expected_sum, w, 1e-5))


def test_rms_norm_module_paths_agree(monkeypatch):
    from meshserve.layers.norm import RMSNorm

    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64)
    x, residual = torch.randn(7, 64), torch.randn(7, 64)
    fused_out, fused_sum = norm(x, residual.clone())
    monkeypatch.setenv("MESHSERVE_DISABLE_CPU_KERNELS", "1")
    plain_out, plain_sum = norm(x, residual.clone())
    torch.testing.assert_close(fused_sum, plain_sum)
    torch.testing.assert_close(fused_out, plain_out)


def test_silu_and_mul_matches_torch_including_extremes(isa):
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(33, 2 * 200, generator=g) * 6
    gate_up[0, :6] = torch.tensor([-200.0, -88.0, -20.0, 0.0, 20.0, 100.0])  # clamped exp range and beyond
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_and_mul(gate_up), F.silu(gate) * up, rtol=2e-6, atol=1e-6)


def test_rotary_in_place_matches_module_formula():
    from meshserve.layers.rotary import RotaryEmbedding

    rot = RotaryEmbedding(64, 512, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 128})
    g = torch.Generator().manual_seed(2)
    t, heads, kv_heads = 11, 9, 3
    qkv = torch.randn(t, (heads + 2 * kv_heads) * 64, generator=g)
    positions = torch.randint(0, 512, (t,), generator=g)
    q, k, v = qkv.split([heads * 64, kv_heads * 64, kv_heads * 64], dim=-1)
    q_ref, k_ref = rot(positions, q.reshape(t, heads, 64), k.reshape(t, kv_heads, 64))
    v_before = v.clone()
    q2, k2, v2 = rot.apply_qkv(positions, qkv, heads, kv_heads)  # the kernel path: in place in qkv
    torch.testing.assert_close(q2, q_ref)
    torch.testing.assert_close(k2, k_ref)
    assert torch.equal(v2.reshape(t, -1), v_before)
    with pytest.raises(RuntimeError, match="position out of range"):
        cpu_kernels.rotary_(qkv, torch.tensor([512] * t), rot.cos, rot.sin, heads + kv_heads, 64)


# ---- pre-packed matmuls ----------------------------------------------------------------------------

# ---- decode GEMV ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", list(range(1, cpu_kernels.GEMV_MAX_ROWS + 1)))
def test_gemv_is_the_float32_product_of_the_stored_values(rows, dtype, isa):
    """Every row count, output counts that leave a tail of weight rows per block and per thread, and
    inner sizes that leave a tail past the vector width (8 or 16 lanes)."""
    assert cpu_kernels.gemv_isa() == (
        "avx512" if isa == "avx512" and {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags() else "avx2")
    g = torch.Generator().manual_seed(rows)
    for n, k in [(1, 1), (3, 13), (67, 77), (200, 96), (1027, 576)]:
        w = torch.randn(n, k, generator=g).to(dtype)
        x = torch.randn(rows, k, generator=g).to(dtype)
        b = torch.randn(n, generator=g).to(dtype)
        expected = F.linear(x.double(), w.double(), b.double())
        out = cpu_kernels.gemv(x, w, b)
        assert out.dtype == dtype and out.shape == (rows, n)
        # float32: the same sum in another order; bfloat16: computed in float32, rounded once
        tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
        torch.testing.assert_close(out.double(), expected, **tol)
        torch.testing.assert_close(cpu_kernels.gemv(x, w), F.linear(x.double(), w.double()).to(dtype),
                                   **tol, check_dtype=False)


def test_gemv_refuses_what_it_cannot_compute():
    w = torch.randn(8, 16)
    assert cpu_kernels.gemv(torch.randn(0, 16), w).shape == (0, 8)  # an expert no token was routed to
    with pytest.raises(RuntimeError, match="rows"):
        cpu_kernels.gemv(torch.randn(cpu_kernels.GEMV_MAX_ROWS + 1, 16), w)
    with pytest.raises(RuntimeError, match="columns"):
        cpu_kernels.gemv(torch.randn(2, 15), w)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_kernels.gemv(torch.randn(2, 8), w.t())


@contextlib.contextmanager
def _row_counts(owner, name: str):
    """The row count of every matmul `owner.name` runs from Python, in order."""
    calls: list[int] = []
    real = getattr(owner, name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(owner, name, lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
        yield calls


def _gemv_row_counts():
    return _row_counts(cpu_kernels, "gemv")


def _panel_row_counts():
    return _row_counts(cpu_kernels, "panel_gemm")


def _packed_row_counts():
    """oneDNN's matmuls on a packed weight."""
    return _row_counts(torch.ops.mkldnn, "_linear_pointwise")


def _small_row_limits(dtype, packing: bool) -> tuple[int, int]:
    """(panel, GEMV) row limits this CPU must choose now: the panels where they run (AVX-512 to
    PANEL_MAX_ROWS, float32 on an Intel CPU to PANEL_MAX_ROWS_INTEL, bfloat16 on their own AMX tiles
    to PANEL_MAX_ROWS_AMX_TILES, else beside oneDNN on AMX to PANEL_MAX_ROWS_AMX; either dtype on AVX2
    to PANEL_MAX_ROWS_AVX2; none for bfloat16 on AVX-512 without BF16) and
    then no GEMV; else the GEMV's AVX-512 path to its measured crossover with oneDNN beside a packed
    weight, otherwise to the GEMV's limit."""
    from meshserve.layers import cpu_gemm

    avx512 = cpu_kernels.gemv_isa() == "avx512"
    intel = cpu_vendor() == "GenuineIntel"
    if avx512 and dtype == torch.float32:
        panel = cpu_gemm.PANEL_MAX_ROWS_INTEL if intel else cpu_gemm.PANEL_MAX_ROWS
    elif avx512 and "avx512_bf16" in cpu_flags():
        if cpu_kernels.panel_bf16_isa() == "amx":
            panel = cpu_gemm.PANEL_MAX_ROWS_AMX_TILES
        else:
            panel = cpu_gemm.PANEL_MAX_ROWS_AMX if packing and "amx_bf16" in cpu_flags() else cpu_gemm.PANEL_MAX_ROWS
    elif not avx512 and {"avx2", "fma"} <= cpu_flags():  # bfloat16 widened to float32 in registers
        panel = cpu_gemm.PANEL_MAX_ROWS_AVX2
    else:
        panel = 0
    gemv = 0 if panel else (cpu_gemm.GEMV_MAX_ROWS_BESIDE_PACKED[dtype] if packing and avx512
                            else cpu_kernels.GEMV_MAX_ROWS)
    assert (cpu_gemm.panel_max_rows(dtype), cpu_gemm.gemv_max_rows(dtype)) == (panel, gemv)
    return panel, gemv


@pytest.mark.parametrize("rows", [1, 3, 4, 9, 16, 17, 64, 65, 128, 129, 700, 1024])  # panels/GEMV, packed, MKL
@pytest.mark.parametrize("bias,lm_head", [(False, False), (True, False), (False, True)])
def test_packed_linear_matches_f_linear(rows, bias, lm_head, isa):
    from meshserve.layers.cpu_gemm import packed_rows
    from meshserve.layers.embedding import ParallelLMHead
    from meshserve.layers.linear import ColumnParallelLinear

    lin = ParallelLMHead(200, 96) if lm_head else ColumnParallelLinear(96, 200, bias=bias)
    g = torch.Generator().manual_seed(rows)
    lin.weight.data = torch.randn(200, 96, generator=g)
    if bias:
        lin.bias.data = torch.randn(200, generator=g)
    lin.prepack()
    assert lin._packed is not None
    panel, gemv = _small_row_limits(torch.float32, packing=True)
    assert (lin._panels is not None) == (panel > 0)
    x = torch.randn(rows, 96, generator=g)
    with _packed_row_counts() as packed, _gemv_row_counts() as streamed, _panel_row_counts() as paneled:
        out = lin(x)
    assert paneled == ([rows] if rows <= panel else [])
    assert streamed == ([rows] if rows <= gemv else [])
    assert packed == ([rows] if max(panel, gemv) < rows <= packed_rows(torch.float32)[1] else [])
    torch.testing.assert_close(out, F.linear(x, lin.weight, getattr(lin, "bias", None)), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("vendor,avx512,top", [("GenuineIntel", True, 128), ("GenuineIntel", False, 128),
                                               ("AuthenticAMD", True, None), ("AuthenticAMD", False, 1023),
                                               ("", True, None), ("", False, 1023)])
def test_float32_prefill_rows_take_mkl_on_intel_or_avx2(vendor, avx512, top, monkeypatch):
    """MKL matches oneDNN's packed weight from a few hundred rows on Intel CPUs and overtakes oneDNN's
    AVX2 kernels from a thousand rows: elsewhere float32 takes the packed weight at every row count."""
    from meshserve.layers import cpu_gemm

    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(cpu_gemm, "cpu_flags", lambda: frozenset({"avx2", "fma"} | ({"avx512f"} if avx512 else set())))
    monkeypatch.setattr(cpu_gemm, "onednn_allows", lambda level: True)
    lo, hi = cpu_gemm.packed_rows(torch.float32)
    assert lo == cpu_gemm.PACKED_MIN_ROWS
    assert hi == top if top else hi > 1 << 40
    # oneDNN capped below AVX-512 (ONEDNN_MAX_CPU_ISA) runs its AVX2 kernels whatever the CPU has
    monkeypatch.setattr(cpu_gemm, "onednn_allows", lambda level: level != "AVX512_CORE")
    assert cpu_gemm.packed_rows(torch.float32)[1] == (top or 1023)
    if cpu_gemm.packs(torch.bfloat16):  # bfloat16 packs every row count on any vendor's CPU
        assert cpu_gemm.packed_rows(torch.bfloat16) == (1, 1 << 62)


def _bf16_packing_paths() -> list[bool]:
    """Whether bf16 weights are packed: both where this CPU can pack them, else only unpacked."""
    return [True, False] if onednn_packs_bf16() else [False]


def _bf16_linear(seed: int):
    """A 96 -> 200 bfloat16 linear layer with a bias, packed as this CPU (as patched) packs it."""
    from meshserve.layers.linear import ColumnParallelLinear

    lin = ColumnParallelLinear(96, 200, bias=True)
    g = torch.Generator().manual_seed(seed)
    lin.weight.data = torch.randn(200, 96, generator=g).bfloat16()
    lin.bias.data = torch.randn(200, generator=g).bfloat16()
    lin.prepack()
    return lin, g


@pytest.mark.parametrize("packing", _bf16_packing_paths())
@pytest.mark.parametrize("rows", [1, 3, 6, 7, 16, 64, 65, 129, 700])
def test_bf16_packed_linear_takes_every_row_count(rows, packing, monkeypatch, isa):
    from meshserve.layers import cpu_gemm

    monkeypatch.setattr(cpu_gemm, "onednn_packs_bf16", lambda: packing)
    lin, g = _bf16_linear(seed=rows)
    assert (lin._packed is not None) == packing
    x = torch.randn(rows, 96, generator=g).bfloat16()
    with _packed_row_counts() as calls, _gemv_row_counts() as streamed, _panel_row_counts() as paneled:
        out = lin(x)
    # a few rows take the panels or stream the weight as stored (_small_row_limits); oneDNN sees
    # more rows padded to whole AMX tiles (one primitive per 16 rows, not per row count); a CPU
    # that cannot pack bf16 (AVX2 only) runs F.linear in float32 past the panels
    panel, most = _small_row_limits(torch.bfloat16, packing)
    assert (lin._panels is not None) == (panel > 0)
    assert paneled == ([rows] if rows <= panel else [])
    assert streamed == ([rows] if rows <= most else [])
    gemv = rows <= max(panel, most)
    assert calls == ([-(-rows // 16) * 16] if packing and not gemv else [])
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 200)
    expected = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=5e-2)
    # a row's result is the same whatever else shares its step (the rows of one path, padded or not)
    width = 1 if gemv else max(panel, most) + 1
    if gemv and rows >= cpu_kernels.PANEL_TILE_MIN_ROWS and cpu_kernels.panel_bf16_isa() == "amx":
        width = cpu_kernels.PANEL_TILE_MIN_ROWS  # from there the panels' AMX tiles, summing in their own order
    alone = torch.cat([lin(x[i:i + width])[:1] for i in range(min(rows - width + 1, 20))])
    assert torch.equal(alone, out[:len(alone)])


@pytest.mark.parametrize("past", [1, 48, 236])
def test_unpackable_bf16_weights_multiply_many_rows_in_float32(past, monkeypatch):
    """Where oneDNN cannot pack bfloat16 (an AVX2-only CPU), rows past the GEMV and the panels widen
    the weight and multiply in float32, rounding the result to bfloat16 once, instead of ATen's
    bfloat16 GEMM."""
    from meshserve.layers import cpu_gemm

    monkeypatch.setattr(cpu_gemm, "onednn_packs_bf16", lambda: False)
    rows = max(_small_row_limits(torch.bfloat16, packing=False)) + past
    lin, g = _bf16_linear(seed=rows)
    assert cpu_gemm.widens_bf16(lin.weight) and lin._packed is None
    x = torch.randn(rows, 96, generator=g).bfloat16()
    real, seen = F.linear, []
    monkeypatch.setattr(cpu_gemm.F, "linear", lambda a, w, b=None: seen.append((a.dtype, w.dtype)) or real(a, w, b))
    out = lin(x)
    assert seen == [(torch.float32, torch.float32)]
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, real(x.float(), lin.weight.float(), lin.bias.float()).bfloat16())
    monkeypatch.setattr(cpu_gemm, "onednn_packs_bf16", lambda: True)  # the rule names this CPU kind only
    assert not cpu_gemm.widens_bf16(lin.weight) and not cpu_gemm.widens_bf16(lin.weight.float())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_warm_up_builds_the_row_counts_that_steps_bring(tmp_path, dtype):
    from tiny_model import tiny_runner

    from meshserve.sampling_params import SamplingParams
    from meshserve.worker.step import SeqStep, StepInput

    chunk = 200  # a prompt chunk beside decodes: more rows than the panels take on any CPU
    with _packed_row_counts() as warmed:  # the runner builds them as it starts
        runner = tiny_runner(tmp_path, max_model_len=256, dtype=dtype, max_num_seqs=8, prefill_chunk_with_decodes=chunk)
    if dtype == "float32" or not onednn_packs_bf16():  # unpadded row counts: too many to build ahead
        assert warmed == []
        return
    # from the first row past the panels' or the GEMV's in whole tiles of 16: four decoder weight
    # shapes up to chunk + 8 token rows, and the LM head up to its 8 sequences
    from meshserve.layers.cpu_gemm import gemv_max_rows, panel_max_rows
    first = -(-(max(gemv_max_rows(torch.bfloat16), panel_max_rows(torch.bfloat16)) + 1) // 16) * 16
    decoder = [r for r in range(first, chunk + 8 + 1, 16) for _ in range(4)]
    assert sorted(warmed) == sorted(decoder + ([16] if first <= 16 else []))
    model = runner.model
    model.cpu_stack = None  # the module path, whose matmuls Python sees
    runner.init_kv_cache(64)
    greedy = SamplingParams(temperature=0)
    block = runner.config.block_size
    steps = [StepInput([SeqStep(i, [1 + i] * (block - 5 + i), 0, [i], True, greedy) for i in range(5)]),  # 5 prompts
             StepInput([SeqStep(5, [7] * chunk, 0, list(range(5, 5 + -(-chunk // block))), True, greedy)]  # a chunk
                       + [SeqStep(i, [2], block - 5 + i, [i], True, greedy) for i in range(5)])]  # beside 5 decodes
    with _packed_row_counts() as used, torch.inference_mode():
        for step in steps:
            hidden, rows = runner.forward(step)
            runner.sample(step, hidden[rows])
    assert used and set(used) <= set(warmed)


def test_packing_off_when_disabled_or_not_float32_or_bf16(monkeypatch):
    from meshserve.layers.linear import RowParallelLinear

    lin = RowParallelLinear(32, 16)
    lin.weight.data = torch.randn(16, 32).half()
    lin.prepack()
    assert lin._packed is None
    lin.weight.data = torch.randn(16, 32)
    monkeypatch.setenv("MESHSERVE_DISABLE_CPU_KERNELS", "1")
    lin.prepack()
    assert lin._packed is None
    x = torch.randn(4, 32)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight))


def test_engine_with_cpu_kernels_generates_as_without(monkeypatch):
    """End to end on the default model: packed matmuls, fused norms/rotary/SiLU and the decode
    kernel against the plain PyTorch path, greedy ids and top logprobs (float32 weights: the quantized
    GEMV is tested against its own reference in test_quant_gemv.py)."""
    from meshserve import LLM, SamplingParams

    prompts = [list(range(200, 230)), "The capital of France is", list(range(5000, 5100))]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)

    def run():
        llm = LLM("default", dtype="float32", quantization="none", max_model_len=256, kv_cache_memory_bytes=16 << 20)
        try:
            return llm.generate(prompts, params)
        finally:
            llm.engine.shutdown()

    fast = run()
    monkeypatch.setenv("MESHSERVE_DISABLE_CPU_KERNELS", "1")
    plain = run()
    for a, b in zip(fast, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for tok, lp in la.items():
                assert abs(lp - lb[tok]) < 1e-3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_steps_take_their_tokens_from_the_lm_head_without_logits(dtype, monkeypatch):
    """Steps whose rows are all plain greedy get their tokens from the LM head's panels without
    logits (panel_argmax): the same tokens as through the logits. A batch with a row that needs the
    logits (logprobs here) computes them."""
    from meshserve import LLM, SamplingParams
    from meshserve.layers.cpu_gemm import PrepackedMatmul

    if not cpu_kernels.panel_argmax_usable(getattr(torch, dtype)):
        pytest.skip("panel_argmax does not run here")
    fused_rows: list[int] = []
    real = cpu_kernels.panel_argmax
    monkeypatch.setattr(cpu_kernels, "panel_argmax", lambda x, *a: fused_rows.append(x.shape[0]) or real(x, *a))
    prompts = ["The capital of France is", list(range(200, 260)), "def fibonacci(n):"]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM("default", dtype=dtype, quantization="none", max_model_len=128, kv_cache_memory_bytes=16 << 20)
    try:
        fused = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        assert fused_rows and max(fused_rows) == len(prompts)  # every step's sampling rows
        fused_rows.clear()
        with_logprobs = llm.generate(prompts[:2] + [prompts[2]], [greedy, greedy,
                                     SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)])
        assert not fused_rows
        assert [o.outputs[0].token_ids for o in with_logprobs] == fused
        monkeypatch.setattr(PrepackedMatmul, "argmax", lambda self, x, n: None)  # logits and argmax_rows
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == fused
    finally:
        llm.engine.shutdown()


def test_bf16_engine_follows_float32_greedy():
    """bfloat16 end to end (packed AMX matmuls, the C++ layer loop, bf16 KV cache) on the default
    model: on natural prompts its greedy text starts as float32's, with logprobs close to
    float32's while the two agree."""
    from meshserve import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True)

    def run(dtype):
        llm = LLM("default", dtype=dtype, quantization="none", max_model_len=128, kv_cache_memory_bytes=16 << 20)
        try:
            return llm.generate(prompts, params)
        finally:
            llm.engine.shutdown()

    bf16, fp32 = run("bfloat16"), run("float32")
    for a, b in zip(bf16, fp32):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert ta[:2] == tb[:2]
        for i, (x, y) in enumerate(zip(ta, tb)):
            if x != y:
                break
            assert abs(a.outputs[0].logprobs[i][x] - b.outputs[0].logprobs[i][y]) < 0.15
