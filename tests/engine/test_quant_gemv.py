"""The quantized-weight kernels (csrc/quant_gemv.cpp) read every GGUF block type they support, and
int8 rows, as the `gguf` package's own dequantization reads them: `qdequantize` equals it exactly,
and `qgemv` is the float64 product of x with it up to float32 summation, for every row count of a
decode step, ragged output sizes, float32 and bfloat16 activations and each ISA path this CPU runs."""
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from meshserve.layers import cpu_kernels

# Byte offsets of each block's float16 scale fields: random bytes there could be inf or NaN.
_HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
                "Q6_K": [208]}
INT8_ROWS = 100  # kInt8Rows in csrc/quant_gemv.cpp


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_kernels.available(), "the C++ kernel must build here (g++ and ninja are installed)"


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


BLOCK_TYPES = list(_HALF_FIELDS)


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_dequantize_equals_the_gguf_reference(name, isa):
    data, reference = _blocks(name, 37, 512)
    assert torch.equal(cpu_kernels.qdequantize(data, int(GGMLQuantizationType[name]), 512), reference)


@pytest.mark.parametrize("name", BLOCK_TYPES)
@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qgemv_is_the_product_with_the_dequantized_weight(name, rows, dtype, isa):
    k = 768 if name.endswith("_K") else 96  # several super-blocks / blocks per row
    data, weight = _blocks(name, 45, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    bias = torch.randn(45).to(dtype)
    y = cpu_kernels.qgemv(x, data, int(GGMLQuantizationType[name]), None, bias)
    assert y.shape == (rows, 45) and y.dtype == dtype
    expected = x.double() @ weight.double().T + bias.double()
    # float32 summation error grows with sum |x w|; bfloat16 adds one rounding of the output
    magnitude = (x.double().abs() @ weight.double().abs().T).abs().sum().item() / max(1, rows * 45) + 1.0
    tol = magnitude * (1e-5 if dtype == torch.float32 else 1e-2)
    torch.testing.assert_close(y.double(), expected, atol=tol, rtol=0)


@pytest.mark.parametrize("rows", [1, 7, 16])
def test_int8_rows_apply_their_scale(rows, isa):
    g = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (29, 64), generator=g, dtype=torch.int8)
    scale = torch.rand(29, generator=g) * 0.01
    data = q.view(torch.uint8)
    weight = q.double() * scale.double()[:, None]
    torch.testing.assert_close(cpu_kernels.qdequantize(data, INT8_ROWS, 64, scale).double(), weight,
                               rtol=1e-6, atol=0)
    x = torch.randn(rows, 64, generator=g)
    torch.testing.assert_close(cpu_kernels.qgemv(x, data, INT8_ROWS, scale).double(), x.double() @ weight.T,
                               rtol=0, atol=1e-5)


def test_the_kernels_refuse_what_they_cannot_read():
    data, _ = _blocks("Q4_1", 4, 64)
    q41 = int(GGMLQuantizationType.Q4_1)
    with pytest.raises(RuntimeError, match="not a multiple of the block size"):
        cpu_kernels.qgemv(torch.randn(1, 48), data, q41)
    with pytest.raises(RuntimeError, match="expected 40"):
        cpu_kernels.qgemv(torch.randn(1, 64), data[:, :30].contiguous(), q41)
    with pytest.raises(RuntimeError, match="unknown block type"):
        cpu_kernels.qdequantize(data, 99, 64)
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        cpu_kernels.qgemv(torch.randn(17, 64), data, q41)
    with pytest.raises(RuntimeError, match="row scale"):
        cpu_kernels.qgemv(torch.randn(1, 64), data, q41, torch.ones(4))
