"""The panel GEMM (csrc/panel_gemm.cpp): the product of the stored values for any row count on
every path this CPU runs (AVX-512, AVX2, AMX tiles), each row's result independent of the rows beside it, and
refusals of what it cannot compute; its argmax without the outputs (a greedy step's LM head)."""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve.layers import cpu_kernels

DTYPES = [torch.float32, torch.bfloat16]


def _runs(dtype: torch.dtype) -> None:
    if not cpu_kernels.panel_usable(dtype):
        pytest.skip("panel_gemm needs AVX2 or AVX-512 (bfloat16: with BF16) here")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(1, 1), (47, 3), (48, 96), (49, 97), (200, 96), (1027, 576)])
def test_panels_hold_the_weight_k_major(n, k, dtype):
    w = torch.randn(n, k).to(dtype)
    panels = cpu_kernels.pack_panels(w)
    width = cpu_kernels.PANEL_WIDTH
    if dtype == torch.bfloat16:
        unpacked = panels.permute(0, 2, 1, 3).reshape(-1, panels.shape[1] * 2)
    else:
        unpacked = panels.transpose(1, 2).reshape(-1, k)
    assert unpacked.shape[0] == -(-n // width) * width
    assert torch.equal(unpacked[:n, :k], w)
    assert not unpacked[n:].any() and not unpacked[:, k:].any()  # padding is zero


@contextlib.contextmanager
def _bf16_kernel(kernel: str | None):
    """bfloat16 from 9 rows on through AMX tiles (where this CPU has them) or the register blocks."""
    if kernel is None:
        yield
        return
    if kernel == "tiles" and cpu_kernels.panel_bf16_isa() != "amx":
        pytest.skip("no AMX-BF16 here (or the OS does not give this process the tile registers)")
    previous = cpu_kernels.allow_amx(kernel == "tiles")
    try:
        yield
    finally:
        cpu_kernels.allow_amx(previous)


@pytest.mark.parametrize("dtype,kernel", [(torch.float32, None), (torch.bfloat16, "blocks"), (torch.bfloat16, "tiles")])
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 8, 9, 12, 16, 17, 33, 64, 70])
def test_panel_gemm_is_the_float32_product_of_the_stored_values(rows, dtype, kernel, isa):
    """Every register-block split of the rows (8 at most per block on AVX-512, pairs on AVX2),
    output counts that leave a partial last panel, inner sizes odd and even, and on AVX2 inner
    sizes over one or several of its slices of K, whole and partial. Through AMX tiles: rows that
    fill the last 16-row tile or not, inner sizes in whole tiles of 32, with a remainder, or below
    one tile."""
    _runs(dtype)
    with _bf16_kernel(kernel):
        tiles = kernel == "tiles" and rows >= cpu_kernels.PANEL_TILE_MIN_ROWS
        _check_panel_gemm(rows, dtype, group=cpu_kernels.PANEL_TILE_MIN_ROWS if tiles else 1)


def _check_panel_gemm(rows: int, dtype: torch.dtype, group: int) -> None:
    """group: the fewest rows that take the kernel `rows` rows take (the tiles sum in their own order)."""
    g = torch.Generator().manual_seed(rows)
    for n, k in [(1, 1), (47, 13), (49, 97), (200, 96), (1027, 576), (100, 250), (50, 33), (96, 1535)]:
        w = torch.randn(n, k, generator=g).to(dtype)
        b = torch.randn(n, generator=g).to(dtype)
        wide = torch.randn(rows, k + 5, generator=g).to(dtype)
        x = wide[:, :k]  # rows with a stride past their length, as slices of a fused output are
        panels = cpu_kernels.pack_panels(w)
        out = cpu_kernels.panel_gemm(x, panels, n, b)
        assert out.dtype == dtype and out.shape == (rows, n)
        expected = F.linear(x.double(), w.double(), b.double())
        # float32: the same sum in another order; bfloat16: products exact, summed in float32, rounded once
        tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
        torch.testing.assert_close(out.double(), expected, **tol)
        torch.testing.assert_close(cpu_kernels.panel_gemm(x, panels, n), F.linear(x.double(), w.double()).to(dtype),
                                   **tol, check_dtype=False)
        # a row's result does not depend on how many rows share the call
        for i in range(0, rows - group + 1, 7):
            assert torch.equal(cpu_kernels.panel_gemm(x[i:i + group], panels, n, b)[:1], out[i:i + 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 64])
def test_every_thread_count_computes_every_panel(rows, dtype):
    """The threads take the panels in runs that shrink as the work runs out: for any thread count
    (more threads than cores included) every panel is computed, bit for bit as on one thread."""
    _runs(dtype)
    g = torch.Generator().manual_seed(rows)
    n, k = 48 * 101 - 5, 96  # 101 panels, the last one partial
    w, x = torch.randn(n, k, generator=g).to(dtype), torch.randn(rows, k, generator=g).to(dtype)
    panels = cpu_kernels.pack_panels(w)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_kernels.panel_gemm(x, panels, n)
        for threads in (2, 3, 5):
            torch.set_num_threads(threads)
            assert torch.equal(cpu_kernels.panel_gemm(x, panels, n), alone), threads
    finally:
        torch.set_num_threads(previous)


def test_panel_gemm_refuses_what_it_cannot_compute():
    _runs(torch.float32)
    w = torch.randn(100, 32)
    panels = cpu_kernels.pack_panels(w)
    with pytest.raises(RuntimeError, match="200 outputs"):
        cpu_kernels.panel_gemm(torch.randn(2, 32), panels, 200)
    with pytest.raises(RuntimeError, match="31 columns"):
        cpu_kernels.panel_gemm(torch.randn(2, 31), panels, 100)
    with pytest.raises(RuntimeError, match="dtype"):  # float32 rows: a check every CPU with panels reaches
        cpu_kernels.panel_gemm(torch.randn(2, 32), panels.bfloat16(), 100)
    previous = cpu_kernels.allow_avx512(False)
    try:  # without AVX-512 both dtypes take the AVX2 path, bfloat16 widened in registers
        assert cpu_kernels.panel_isa() == "avx2" and cpu_kernels.panel_bf16_isa() == "avx2"
        assert cpu_kernels.panel_usable(torch.bfloat16) and not cpu_kernels.panel_argmax_usable(torch.float32)
        with pytest.raises(RuntimeError, match="needs AVX-512"):
            cpu_kernels.panel_argmax(torch.randn(2, 32), panels, 100)
    finally:
        cpu_kernels.allow_avx512(previous)


def _argmax_runs(dtype: torch.dtype) -> None:
    if not cpu_kernels.panel_argmax_usable(dtype):
        pytest.skip("panel_argmax needs AVX-512 here" + (" with BF16" if dtype == torch.bfloat16 else ""))


@pytest.mark.parametrize("dtype,kernel", [(torch.float32, None), (torch.bfloat16, "blocks"), (torch.bfloat16, "tiles")])
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 70), k=st.sampled_from([1, 13, 32, 33, 96, 97]), outputs=st.integers(1, 260),
       cut=st.integers(0, 60), ties=st.booleans(), bias=st.sampled_from(["none", "random", "-inf", "nan"]),
       nan_row=st.booleans(), threads=st.integers(1, 3), seed=st.integers(0, 2 ** 16))
def test_panel_argmax_is_the_argmax_of_panel_gemms_outputs(dtype, kernel, rows, k, outputs, cut, ties, bias, nan_row,
                                                          threads, seed):
    """For every path (AVX-512 blocks, AVX512-BF16 blocks, AMX tiles) and any mix of row count,
    inner size, outputs (a partial last panel; fewer than the panels hold), ties (small integers: equal
    sums in different panels, lanes and threads), a bias (with -inf columns, or all -inf: index 0;
    a NaN column: the first NaN), a row of NaN inputs and thread count: the same index as torch's
    argmax of panel_gemm's outputs."""
    _argmax_runs(dtype)
    g = torch.Generator().manual_seed(seed)
    n = max(1, outputs - cut)  # the argmax over the first n of the panels' outputs
    if ties:
        w = torch.randint(-2, 3, (outputs, k), generator=g).to(dtype)
        x = torch.randint(-2, 3, (rows, k), generator=g).to(dtype)
    else:
        w, x = torch.randn(outputs, k, generator=g).to(dtype), torch.randn(rows, k, generator=g).to(dtype)
    b = None if bias == "none" else torch.randn(outputs, generator=g).to(dtype)
    if bias == "-inf":
        b[torch.rand(outputs, generator=g) < 0.7] = float("-inf")
        if seed % 3 == 0:
            b[:] = float("-inf")
    elif bias == "nan":
        b[int(torch.randint(0, outputs, (1,), generator=g))] = float("nan")
    if nan_row:
        x[int(torch.randint(0, rows, (1,), generator=g)), 0] = float("nan")
    panels = cpu_kernels.pack_panels(w)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with _bf16_kernel(kernel):
            got = cpu_kernels.panel_argmax(x, panels, n, b)
            expected = cpu_kernels.panel_gemm(x, panels, outputs, b)[:, :n].argmax(dim=-1)
    finally:
        torch.set_num_threads(previous)
    assert got.dtype == torch.long and torch.equal(got, expected)


def test_panel_argmax_refuses_what_it_cannot_run():
    _argmax_runs(torch.float32)
    panels = cpu_kernels.pack_panels(torch.randn(100, 32))
    with pytest.raises(RuntimeError, match="200 outputs"):
        cpu_kernels.panel_argmax(torch.randn(2, 32), panels, 200)
    previous = cpu_kernels.allow_avx512(False)
    try:  # the float32 AVX2 path writes its outputs only
        assert not cpu_kernels.panel_argmax_usable(torch.float32) and cpu_kernels.panel_usable(torch.float32)
        with pytest.raises(RuntimeError, match="AVX-512"):
            cpu_kernels.panel_argmax(torch.randn(2, 32), panels, 100)
    finally:
        cpu_kernels.allow_avx512(previous)
