"""The quantized-weight kernels (csrc/quant_gemv.cpp) read every GGUF block type they support, int8
rows and float8 e4m3 rows as the reference dequantizations read them: `qdequantize` equals the `gguf`
package's (and, for fp8 rows, torch's float8_e4m3fn conversion times the row scale) exactly.

`qgemv` takes one of two paths. The float path is the float64 product of x with the dequantized
weight up to float32 summation. The integer paths (AVX512-VNNI, AVX-512, AVX-VNNI, AVX2) first round
each run of 32 values of x to int8 with the scale max|x| / 127; their result is the float64 product
of the dequantized weight with that rounded x, again up to float32 summation, and stays within 1% of
the unrounded product. Each is checked for every row count of a decode step, ragged output sizes,
float32 and bfloat16 activations, with and without bias, on every path this CPU runs."""
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from meshserve.layers import cpu_kernels

# Byte offsets of each block's float16 scale fields: random bytes there could be inf or NaN.
_HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
                "Q6_K": [208]}
BLOCK_TYPES = list(_HALF_FIELDS)
INT8_ROWS = 100  # kInt8Rows in csrc/quant_gemv.cpp
FP8_ROWS = 101  # kFp8Rows
ROWS = [0, 1, 3, 4, 5, 8, 16]
# The paths qgemv can be forced onto; the float one at both widths of its compiled code.
PATHS = ["vnni512", "avxvnni", "avx512", "avx2", "float", "float-avx2"]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_kernels.available(), "the C++ kernel must build here (g++ and ninja are installed)"


@pytest.fixture(params=PATHS)
def isa(request):
    """Runs a test on one of qgemv's paths (skipped where this CPU lacks it); replaces conftest's
    `isa`, whose two settings reach only the widest integer path and the AVX2 one."""
    name = request.param
    previous_path = cpu_kernels.set_quant_isa("auto")
    previous_wide = cpu_kernels.allow_avx512(name != "float-avx2")
    try:
        cpu_kernels.set_quant_isa(name.removesuffix("-avx2"))
    except RuntimeError:
        cpu_kernels.allow_avx512(previous_wide)
        cpu_kernels.set_quant_isa(previous_path)
        pytest.skip(f"this CPU has no {name} path")
    assert cpu_kernels.quant_isa() == name.removesuffix("-avx2")
    yield name
    cpu_kernels.allow_avx512(previous_wide)
    cpu_kernels.set_quant_isa(previous_path)


def _blocks(name: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks of a type (every bit pattern of the quants, scales of both signs) and the
    float32 weight the gguf package reads from them."""
    qtype = GGMLQuantizationType[name]
    values, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // values, nbytes), dtype=np.uint8)
    for at in _HALF_FIELDS[name]:
        halves = rng.uniform(-0.05, 0.05, size=(n, k // values)).astype(np.float16)
        raw[:, :, at:at + 2] = halves.view(np.uint8).reshape(n, k // values, 2)
    raw = raw.reshape(n, -1)
    return torch.from_numpy(raw.copy()), torch.from_numpy(dequantize(raw, qtype).reshape(n, k).astype(np.float32))


def _fp8_bytes(n: int, k: int, seed: int) -> torch.Tensor:
    """Random float8 e4m3 bit patterns, every one but the NaNs (0x7F, 0xFF)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    return torch.where(data & 0x7F == 0x7F, data ^ 0x01, data)


def _rounded_as_the_integer_path(x: torch.Tensor) -> torch.Tensor:
    """x as the integer paths read it, in float64: each run of 32 values scaled by d = max|x| / 127
    and rounded to the nearest integer (ties to even), all in float32 as the kernel computes it; a run
    whose 1 / d overflows (subnormal values) reads as zeros."""
    xf = x.float().reshape(x.shape[0], x.shape[1] // 32, 32)
    d = xf.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    unreadable = torch.isinf(inv)
    d, inv = d.masked_fill(unreadable, 0), inv.masked_fill(unreadable, 0)
    return (torch.round(xf * inv).double() * d.double()).reshape(x.shape)


def _integer_path(isa: str, block_type: int) -> bool:
    return not isa.startswith("float") and block_type != FP8_ROWS


def _check_product(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   block_type: int, isa: str) -> None:
    """y against the float64 product of the x the path reads with the float64 weight, within float32
    summation error (bfloat16: plus one rounding of the output)."""
    xr = _rounded_as_the_integer_path(x) if _integer_path(isa, block_type) else x.double()
    expected = xr @ weight.double().T
    if bias is not None:
        expected = expected + bias.double()
    rows, n = expected.shape
    magnitude = (xr.abs() @ weight.double().abs().T).sum().item() / max(1, rows * n) + 1.0
    tol = magnitude * (1e-5 if x.dtype == torch.float32 else 1e-2)
    assert y.shape == expected.shape and y.dtype == x.dtype
    torch.testing.assert_close(y.double(), expected, atol=tol, rtol=0)


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_dequantize_equals_the_gguf_reference(name, isa):
    data, reference = _blocks(name, 37, 512)
    assert torch.equal(cpu_kernels.qdequantize(data, int(GGMLQuantizationType[name]), 512), reference)


@pytest.mark.parametrize("name", BLOCK_TYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qgemv_is_the_product_with_the_dequantized_weight(name, rows, dtype, isa):
    k = 768 if name.endswith("_K") else 96  # several super-blocks / blocks per row
    data, weight = _blocks(name, 45, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    bias = torch.randn(45).to(dtype)
    block_type = int(GGMLQuantizationType[name])
    _check_product(cpu_kernels.qgemv(x, data, block_type, None, bias), x, weight, bias, block_type, isa)
    _check_product(cpu_kernels.qgemv(x, data, block_type), x, weight, None, block_type, isa)


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("rows", [9, 12, 16])
def test_many_rows_and_output_tiles(name, rows, isa):
    """More output rows than one tile of the passes over the weight, and more rows of x than one
    pass takes (on the AVX2 paths), with a few edge runs of x: zeros, and values near the smallest
    normal float."""
    k = 1024
    data, weight = _blocks(name, 300, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0
    x[1, 32:64] *= 1e-37
    block_type = int(GGMLQuantizationType[name])
    _check_product(cpu_kernels.qgemv(x, data, block_type), x, weight, None, block_type, isa)


@pytest.mark.parametrize("rows", [1, 7, 16])
def test_int8_rows_apply_their_scale(rows, isa):
    g = torch.Generator().manual_seed(rows)
    q = torch.randint(-128, 128, (29, 64), generator=g, dtype=torch.int8)
    scale = torch.rand(29, generator=g) * 0.01
    data = q.view(torch.uint8)
    weight = q.double() * scale.double()[:, None]
    torch.testing.assert_close(cpu_kernels.qdequantize(data, INT8_ROWS, 64, scale).double(), weight,
                               rtol=1e-6, atol=0)
    x = torch.randn(rows, 64, generator=g)
    _check_product(cpu_kernels.qgemv(x, data, INT8_ROWS, scale), x, weight, None, INT8_ROWS, isa)


def test_fp8_rows_dequantize_as_torch_reads_float8_e4m3(isa):
    data = _fp8_bytes(41, 256, seed=0)
    scale = torch.rand(41, generator=torch.Generator().manual_seed(1)) * 0.01
    expected = data.view(torch.float8_e4m3fn).float() * scale[:, None]
    assert torch.equal(cpu_kernels.qdequantize(data, FP8_ROWS, 256, scale), expected)
    every_byte = torch.arange(256, dtype=torch.uint8)
    every_byte = every_byte[(every_byte & 0x7F) != 0x7F].repeat(1, 2)[:, :224].contiguous()  # subnormals too
    ones = torch.ones(1)
    assert torch.equal(cpu_kernels.qdequantize(every_byte, FP8_ROWS, 224, ones),
                       every_byte.view(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_rows_qgemv_is_the_product_with_the_dequantized_weight(rows, dtype, isa):
    data = _fp8_bytes(45, 96, seed=rows)
    g = torch.Generator().manual_seed(rows)
    scale = torch.rand(45, generator=g) * 0.01
    weight = data.view(torch.float8_e4m3fn).double() * scale.double()[:, None]
    x = torch.randn(rows, 96, generator=g).to(dtype)
    bias = torch.randn(45, generator=g).to(dtype)
    _check_product(cpu_kernels.qgemv(x, data, FP8_ROWS, scale, bias), x, weight, bias, FP8_ROWS, isa)


@pytest.mark.parametrize("name", BLOCK_TYPES)
@pytest.mark.parametrize("rows", [17, 40, 300])
def test_qmatmul_takes_prefill_rows(name, rows, isa):
    """Prefill's row counts: on the integer paths the kernels tile them (300 rows of K=1024 span two
    panels of x, 300 output rows several tiles of the weight) and round x exactly as for a decode
    step; on the float path they are the float product of the dequantized weight."""
    k = 1024
    data, weight = _blocks(name, 300, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(300)
    block_type = int(GGMLQuantizationType[name])
    y = cpu_kernels.qmatmul(x, data, block_type, None, bias)
    _check_product(y, x, weight, bias, block_type, isa)
    if _integer_path(isa, block_type):  # row i is what a decode step of that one row computes
        assert torch.equal(y[rows - 3:], cpu_kernels.qgemv(x[rows - 3:], data, block_type, None, bias))


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_the_integer_path_stays_within_one_percent_of_the_float_product(name, isa):
    k = 2048
    data, weight = _blocks(name, 64, k, seed=3)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(3))
    y = cpu_kernels.qgemv(x, data, int(GGMLQuantizationType[name])).double()
    exact = x.double() @ weight.double().T
    assert (y - exact).norm() / exact.norm() < (0.01 if _integer_path(isa, 0) else 1e-6)


def test_the_path_is_chosen_from_the_cpu_and_can_be_forced():
    best = cpu_kernels.quant_isa()
    assert best in {"vnni512", "avx512", "avxvnni", "avx2", "float"}
    previous = cpu_kernels.set_quant_isa("float")
    try:
        assert cpu_kernels.quant_isa() == "float"
        with pytest.raises(RuntimeError, match="unknown path"):
            cpu_kernels.set_quant_isa("sse2")
    finally:
        cpu_kernels.set_quant_isa(previous)
    assert cpu_kernels.quant_isa() == best
    if best in {"vnni512", "avx512"}:  # the AVX-512 paths follow allow_avx512 unless forced
        wide = cpu_kernels.allow_avx512(False)
        try:
            assert cpu_kernels.quant_isa() in {"avxvnni", "avx2"}
        finally:
            cpu_kernels.allow_avx512(wide)


def test_the_kernels_refuse_what_they_cannot_read():
    data, _ = _blocks("Q4_1", 4, 64)
    q41 = int(GGMLQuantizationType.Q4_1)
    with pytest.raises(RuntimeError, match="not a multiple of the block size"):
        cpu_kernels.qgemv(torch.randn(1, 48), data, q41)
    with pytest.raises(RuntimeError, match="expected 40"):
        cpu_kernels.qgemv(torch.randn(1, 64), data[:, :30].contiguous(), q41)
    with pytest.raises(RuntimeError, match="unknown block type"):
        cpu_kernels.qdequantize(data, 99, 64)
    previous = cpu_kernels.set_quant_isa("float")
    try:
        with pytest.raises(RuntimeError, match="at most 16 rows on the float path"):
            cpu_kernels.qgemv(torch.randn(17, 64), data, q41)
    finally:
        cpu_kernels.set_quant_isa(previous)
    with pytest.raises(RuntimeError, match="row scale"):
        cpu_kernels.qgemv(torch.randn(1, 64), data, q41, torch.ones(4))
    with pytest.raises(RuntimeError, match="row scale"):
        cpu_kernels.qgemv(torch.randn(1, 64), _fp8_bytes(4, 64, 0), FP8_ROWS)
