"""The Triton matmul of quantized weights (meshserve/layers/quantization/triton_matmul.py), run by the
Triton interpreter on CPU tensors: for every block type the layout made at load reads back bit for bit
as reference.dequantize, the kernel's own dequantization is exact (x = identity rows), and the matmul
is the float64 product with the dequantized weight (plus bias) up to float32 summation, for decode and
prefill row counts, ragged N and K, float32 and float16 and bfloat16 x; split-K, the fp8 bit decoding used on
GPUs without float8 support and the tile choice are checked too."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: CPU tensors, no GPU

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from meshserve.layers.quantization import reference
from meshserve.layers.quantization.blocks import BlockType, QuantizedWeight
from meshserve.layers.quantization.triton_matmul import (
    CudaQuantWeight,
    cuda_quantized_matmul,
    prepare_cuda_weight,
)

CPU = torch.device("cpu")

# Byte offsets of each block's float16 scale fields: random bytes there could be inf or NaN.
_HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
                "Q6_K": [208]}
ALL_TYPES = [t.name for t in BlockType]


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    from meshserve.layers.quantization import triton_matmul

    assert type(triton_matmul._quant_matmul_kernel).__name__ == "InterpretedFunction", \
        "TRITON_INTERPRET=1 must be set before the kernels are imported"


def _weight(name: str, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    """Random valid blocks of a GGUF type (every bit pattern of the quants, scales of both signs), or
    int8 / fp8 rows made from a random float weight."""
    rng = np.random.default_rng(seed)
    if name in ("INT8_ROWS", "FP8_E4M3_ROWS"):
        w = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)) * 0.05
        return reference.int8_rows(w) if name == "INT8_ROWS" else reference.fp8_rows(w)
    qtype = GGMLQuantizationType[name]
    values, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // values, nbytes), dtype=np.uint8)
    for at in _HALF_FIELDS[name]:
        halves = rng.uniform(-0.05, 0.05, size=(n, k // values)).astype(np.float16)
        raw[:, :, at:at + 2] = halves.view(np.uint8).reshape(n, k // values, 2)
    return QuantizedWeight(torch.from_numpy(raw.reshape(n, -1).copy()), BlockType[name], k)


def _k(name: str, wide: bool = False) -> int:
    if name.endswith("_K"):
        return 512 if wide else 256
    return 96 if wide else 64


def _read_back(w: CudaQuantWeight) -> torch.Tensor:
    """The float32 weight a CudaQuantWeight stands for, read from its documented layout."""
    n, k = w.shape
    if w.bits == 4:
        levels = torch.stack([w.levels & 0x0F, w.levels >> 4], dim=-1).reshape(n, k).int() - w.zero
    else:
        levels = w.levels
    values = levels.float()
    if w.group == 0:
        return values * w.scales[:, None]
    grouped = values.view(n, k // w.group, w.group) * w.scales.float()[:, :, None]
    if w.offsets is not None:
        grouped = grouped + w.offsets.float()[:, :, None]
    return grouped.reshape(n, k)


def _assert_product(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    expected = x.double() @ weight.double().T
    if bias is not None:
        expected += bias.double()
    assert y.shape == expected.shape and y.dtype == x.dtype
    # float32 summation error grows with sum |x w|; bfloat16 rounds the weight and the output
    magnitude = (x.double().abs() @ weight.double().abs().T).abs().sum().item() / max(1, y.numel()) + 1.0
    tol = magnitude * (1e-5 if x.dtype == torch.float32 else 1e-2)
    torch.testing.assert_close(y.double(), expected, atol=tol, rtol=0)


@pytest.mark.parametrize("name", ALL_TYPES)
def test_the_layout_reads_back_exactly(name):
    qw = _weight(name, 45, _k(name, wide=True))
    w = prepare_cuda_weight(qw, CPU)
    assert w.shape == qw.shape and w.block_type == qw.block_type
    assert w.bits in (4, 8) and w.group in (0, 16, 32)
    assert torch.equal(_read_back(w), reference.dequantize(qw))


@pytest.mark.parametrize("name", ALL_TYPES)
def test_the_kernel_dequantizes_exactly(name):
    """x = the identity: every output is one weight times 1 plus zeros, so the float32 weight the
    kernel builds in registers comes out unrounded."""
    qw = _weight(name, 40, _k(name), seed=3)
    k = qw.in_features
    y = cuda_quantized_matmul(torch.eye(k), prepare_cuda_weight(qw, CPU))
    assert torch.equal(y, reference.dequantize(qw).T)


@pytest.mark.parametrize("name", ALL_TYPES)
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_the_matmul_is_the_product_with_the_dequantized_weight(name, rows):
    n = 45 if rows != 5 else 70
    qw = _weight(name, n, _k(name, wide=rows == 5), seed=rows)
    w = prepare_cuda_weight(qw, CPU)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, qw.in_features, generator=g)
    bias = None if rows == 17 else torch.randn(n, generator=g)
    _assert_product(cuda_quantized_matmul(x, w, bias), x, reference.dequantize(qw), bias)


@pytest.mark.parametrize("name,rows,dtype", [("Q4_K", 3, torch.bfloat16), ("Q8_0", 20, torch.bfloat16),
                                             ("FP8_E4M3_ROWS", 2, torch.bfloat16), ("Q4_1", 5, torch.float16),
                                             ("Q6_K", 17, torch.float16), ("INT8_ROWS", 1, torch.float16)])
def test_16_bit_activations(name, rows, dtype):
    """float16 takes the 16-bit tl.dot (as bfloat16 does on GPUs); the interpreter dots bfloat16 in
    float32 (its bfloat16 tl.dot is wrong), so bfloat16 here checks loads, casts and stores."""
    qw = _weight(name, 45, _k(name), seed=7)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, qw.in_features, generator=g).to(dtype)
    bias = torch.randn(45, generator=g).to(dtype)
    _assert_product(cuda_quantized_matmul(x, prepare_cuda_weight(qw, CPU), bias), x, reference.dequantize(qw), bias)


@pytest.mark.parametrize("name", ["Q4_0", "Q6_K"])
def test_prefill_tiles_and_leading_dimensions(name):
    """70 rows take the largest tiles (64 x 128 here); [2, 35, K] inputs flatten to rows."""
    qw = _weight(name, 70, _k(name), seed=11)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 35, qw.in_features, generator=g)
    bias = torch.randn(70, generator=g)
    y = cuda_quantized_matmul(x, prepare_cuda_weight(qw, CPU), bias)
    assert y.shape == (2, 35, 70)
    _assert_product(y.reshape(70, 70), x.reshape(70, -1), reference.dequantize(qw), bias)


@pytest.mark.parametrize("name", ["Q4_K", "INT8_ROWS"])
def test_split_k_sums_the_same_product(name):
    from meshserve.layers.quantization.triton_matmul import _launch, _Tiles

    qw = _weight(name, 45, 512, seed=5)
    w = prepare_cuda_weight(qw, CPU)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 512, generator=g)
    bias = torch.randn(45, generator=g)
    y = _launch(x, w, bias, _Tiles(16, 32, 64, split_k=3))  # 8 K-blocks in 3 splits: 3, 3, 2
    _assert_product(y, x, reference.dequantize(qw), bias)
    torch.testing.assert_close(y, _launch(x, w, bias, _Tiles(16, 32, 64)), rtol=0, atol=1e-4)


def test_fp8_bits_decoded_without_native_float8():
    """Every finite e4m3 byte, read through the kernel's own bit decoding (GPUs below compute
    capability 8.9) and through Triton's conversion: both equal torch's float8 reading."""
    from meshserve.layers.quantization.triton_matmul import _launch, _Tiles

    data = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    data[data == 0x7F] = 0  # the NaN bytes (fp8_rows never writes them)
    data[data == 0xFF] = 0
    qw = QuantizedWeight(data.reshape(8, 32), BlockType.FP8_E4M3_ROWS, 32, torch.ones(8))
    w = prepare_cuda_weight(qw, CPU)
    x = torch.eye(32)
    for native in (True, False):
        y = _launch(x, w, None, _Tiles(32, 16, 32), fp8_native=native)
        assert torch.equal(y, reference.dequantize(qw).T), native


def test_tile_choice():
    from meshserve.layers.quantization.triton_matmul import _tiles

    for m in (1, 7, 16, 17, 33, 64, 65, 128, 4096):
        for n, k in ((45, 64), (4096, 4096), (14336, 4096), (4096, 14336), (152064, 8192)):
            for sms in (1, 132):
                t = _tiles(m, n, k, sms)
                assert min(t.block_m, t.block_n, t.block_k) >= 16
                assert t.block_k % 32 == 0 and t.block_k & (t.block_k - 1) == 0
                assert 1 <= t.split_k <= max(1, k // t.block_k)
                if m > 16 or sms == 1:
                    assert t.split_k == 1
    assert _tiles(1, 4096, 4096, 132).split_k > 1  # a decode of 128 output tiles on 132 SMs splits K


def test_w8a8_never_runs_on_cpu():
    from meshserve.layers.quantization.triton_matmul import _w8a8_usable

    qw = _weight("FP8_E4M3_ROWS", 64, 64, seed=2)
    w = prepare_cuda_weight(qw, CPU)
    w.w8a8 = True
    x = torch.randn(80, 64).bfloat16()
    assert not _w8a8_usable(x, w)
    _assert_product(cuda_quantized_matmul(x, w), x, reference.dequantize(qw), None)


def test_empty_rows_and_wrong_width():
    w = prepare_cuda_weight(_weight("Q8_0", 8, 64), CPU)
    assert cuda_quantized_matmul(torch.randn(0, 64), w).shape == (0, 8)
    with pytest.raises(ValueError, match="features"):
        cuda_quantized_matmul(torch.randn(2, 32), w)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="W8A8 fp8 needs a GPU with fp8 tensor cores")
def test_w8a8_on_gpu():
    from meshserve.layers.quantization.triton_matmul import _w8a8_matmul

    dev = torch.device("cuda")
    qw = _weight("FP8_E4M3_ROWS", 128, 256, seed=4)
    w = prepare_cuda_weight(qw, dev)
    x = torch.randn(64, 256, device=dev).bfloat16()
    bias = torch.randn(128, device=dev).bfloat16()
    y = _w8a8_matmul(x, w, bias)
    expected = x.double() @ reference.dequantize(qw).double().T.to(dev) + bias.double()
    # x rounded to e4m3 (3 mantissa bits): about 2**-4 of each term, mostly cancelling
    assert (y.double() - expected).abs().max().item() < 0.1 * expected.abs().max().item()
