"""CPU matmuls: the C++ panel GEMM (AVX-512 or AVX2) or GEMV for a few rows, then oneDNN with
weights packed once at load time (float32 for small batches, bfloat16 for every batch), then MKL.

Where the CPU has AVX-512 or AVX2 (bfloat16: AVX512-BF16), every linear weight gets a second
packing at load time, in panels of outputs (csrc/panel_gemm.cpp), and steps of up to
panel_max_rows rows take it: its outputs run across the vector lanes, so it streams the weight at
86-97% of the read bandwidth from 1 to 8 rows on AVX-512, where oneDNN reached 58-74% and the GEMV
fell from 90% at one row to 50% at eight, and it stays ahead of oneDNN to a few dozen rows; on AVX2
four rows take as long as one and eight 1.6x, where the GEMV took 1.8x and 2.7x (measured by
benchmarks/small_m_gemm.py). Each row's sums are the same whatever else shares the step. The panels
cost one more copy of each linear weight. Elsewhere the GEMV and oneDNN share the few rows as below.
Where the CPU has AMX-BF16, bfloat16 rows from 9 on multiply the same panels as AMX tiles, which
keep up with the weight's stream where the register blocks turn compute-bound: ahead of oneDNN to
about a hundred rows there (PANEL_MAX_ROWS_AMX_TILES), so decode steps of up to 128 sequences take
them and oneDNN keeps the prompt chunks.

Up to a few rows (decode steps of a few sequences) a linear layer streams its weight from memory
once; the C++ GEMV (csrc/gemv.cpp) reads it as stored, in float32 or bfloat16, at the memory's
pace, where MKL and oneDNN spend more on per-call packing and set-up than on the stream. As rows
are added the GEMV turns compute-bound sooner than oneDNN's blocked kernel on the packed weight
(its sums run along K and end in a horizontal add per output), so a packed dtype hands over to
oneDNN at the crossover measured by benchmarks/small_m_gemm.py (GEMV_MAX_ROWS_BESIDE_PACKED); a
dtype that is not packed here keeps the GEMV to its limit (cpu_kernels.GEMV_MAX_ROWS).

From there on MKL's sgemm, which `F.linear` calls, packs panels of the weight on every call, work
that a few dozen rows cannot amortise; oneDNN reads a weight packed once into its own blocked
layout. On an Intel CPU, from a few hundred rows on (prefill chunks), MKL amortises its packing and
is as fast, so those keep `F.linear` (PACKED_MAX_ROWS_INTEL); where oneDNN has AVX2 kernels only,
MKL is faster from about a thousand rows (PACKED_MAX_ROWS_AVX2); elsewhere float32 takes oneDNN
at every row count. Where the GEMV cannot run (no kernels built), decode rows take oneDNN from
PACKED_MIN_ROWS (its per-call setup outweighs its gain on a decoder layer below that).
The packed copy costs one more copy of each linear weight in host memory.
In bfloat16, `F.linear` reorders the weight on every call and oneDNN runs on AMX tiles where the
CPU has them, so bfloat16 always takes the packed weight. On a CPU without the instructions
oneDNN's bfloat16 linear needs (AVX-512 BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only part), bfloat16
weights stay unpacked, and rows past the GEMV's multiply in float32: the weight widened for the
call, then `F.linear`, the result rounded to bfloat16 once (ATen's own bfloat16 GEMM, which
`F.linear` takes there, ran 5x slower than float32 on 256 rows; see widens_bf16).
MESHSERVE_DISABLE_CPU_KERNELS=1 turns packing off.
The crossovers below were measured on SmolLM2's shapes (docs/performance.md).

oneDNN builds (and JIT-compiles) a primitive for every row count it meets, milliseconds per weight
shape the first time, and a served step's row count (prompt chunk plus running decodes) is new
every few steps. In bfloat16 the rows are padded to a multiple of 16 (one AMX tile), which leaves a
few dozen row counts in use, and the runner builds those at start-up (warm_up_packed). An AMX
matmul works in 16-row tiles anyway, so the padding costs nothing once warm.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from meshserve.layers import cpu_kernels
from meshserve.layers.quantization.matmul import QuantizedMatmul
from meshserve.utils import huge_pages
from meshserve.utils.cpuinfo import cpu_bf16_matmul_isa, cpu_flags, cpu_vendor, onednn_allows, onednn_packs_bf16

# MKL's sgemm, which F.linear calls, takes its fastest paths on Intel CPUs: there it matches oneDNN's
# packed weight from a few hundred rows (the crossover measured between 150 and 250 rows on two
# Xeons) without oneDNN's first call per new row count. Elsewhere oneDNN was faster at every row
# count measured (1.2-1.4x from 4 to 1024 float32 rows on a Zen 4 EPYC, benchmarks/small_m_gemm.py).
PACKED_MAX_ROWS_INTEL = 128
# Where oneDNN's float32 kernels are AVX2 (no AVX-512, or oneDNN capped below it), MKL's sgemm
# overtakes them on steps of a thousand rows and more (prompt chunks of an offline batch or a burst):
# on a Zen 3 EPYC, both cores, SmolLM2's decoder shapes (benchmarks/small_m_gemm.py), MKL/oneDNN
# time 0.99-1.10 at 256 rows, 1.00 at 512, 0.91 at 1024, 0.83-0.91 at 2048 (MKL at 98-100% of the
# matmul peak, oneDNN at 83-90%); an offline batch of 2,048-token steps took 0.94-0.95x the time.
PACKED_MAX_ROWS_AVX2 = 1023
# Below this many rows oneDNN's setup per call outweighs what it saves on a decoder layer's weights;
# an LM head, tens of times larger, gains from one row on (PACKED_MIN_ROWS_LM_HEAD).
PACKED_MIN_ROWS = 4
PACKED_MIN_ROWS_LM_HEAD = 1
_ANY_ROWS = (1, 1 << 62)
BF16_ROW_MULTIPLE = 16


_NO_ROWS = (1, 0)
# Where the GEMV runs its AVX-512 path beside a packed weight, the most rows for which it beats
# oneDNN on SmolLM2's decoder shapes, both cores (benchmarks/small_m_gemm.py on a Zen 4 EPYC:
# GEMV/oneDNN time in float32 0.74 at 2 rows, 0.92 at 3, 1.02 at 4, 1.24 at 6; in bfloat16 0.64 at
# 2, 0.96 at 3, 1.08 at 4, 1.31 at 6). Float32 packed matmuls start at PACKED_MIN_ROWS = 4, the row
# after. On the AVX2 path oneDNN's float32 kernels are narrower too and the GEMV won to 16 rows (a
# Zen 3 EPYC).
GEMV_MAX_ROWS_BESIDE_PACKED = {torch.float32: 3, torch.bfloat16: 3}
# The panel GEMM against oneDNN's packed weight on SmolLM2's decoder shapes, both cores, Zen 4 EPYC
# (benchmarks/small_m_gemm.py): time ratio 0.64 at 1 float32 row, 0.66 at 8, 0.92 at 16, 0.98 at
# 32, 1.00 at 64, 1.11 at 128; in bfloat16 0.59 at 1, 0.64 at 8, 0.92 at 16, 0.95 at 32, 1.00 at
# 64, 1.08 at 128. Against the GEMV it was as fast at one row and faster from two.
PANEL_MAX_ROWS = 64
# Its AVX2 path (two rows per register block, K in slices that stay in L1) on the same shapes,
# float32, both cores, a Zen 4 EPYC with AVX-512 masked: time ratio to oneDNN 0.60 at 1 row, 0.53 at
# 4, 0.69 at 8, 0.89 at 16, 1.03 at 24, 1.13 at 32; to the GEMV 1.05 at 1, 0.57 at 4, 0.62 at 8.
PANEL_MAX_ROWS_AVX2 = 16
# Where oneDNN multiplies bfloat16 on AMX tiles it overtakes the panels early: on an Emerald Rapids
# Xeon, both cores, time ratio panels/oneDNN 0.83 at 8 rows, 1.25 at 12, 1.72 at 16, 4.9 at 64. In
# float32 its AVX-512 kernels overtake them at 32 rows on the same Xeon (0.87 at 16, 1.09 at 32,
# 1.23 at 64), not before 64 on the Zen 4 EPYC above.
PANEL_MAX_ROWS_AMX = 8
# Where the panels take AMX tiles themselves from 9 rows (panel_gemm.cpp), they stay ahead of oneDNN
# to about a hundred rows: time ratio panels/oneDNN on the same Xeon, both cores, alternating
# (benchmarks/small_m_gemm.py): 0.65-0.74 at 16 rows, 0.54-0.70 at 32, 0.78-0.95 at 64, 0.75-0.93
# at 128, 0.75-1.11 at 256 (its AMX rate moved with the neighbours' load).
PANEL_MAX_ROWS_AMX_TILES = 128
PANEL_MAX_ROWS_INTEL = 16


def packs(dtype: torch.dtype) -> bool:
    """Weights of this dtype are packed for oneDNN on this machine."""
    if dtype == torch.bfloat16 and not onednn_packs_bf16():
        return False
    return (dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()
            and os.environ.get("MESHSERVE_DISABLE_CPU_KERNELS") != "1")


def row_multiple(dtype: torch.dtype) -> int:
    """Packed matmuls of this dtype run on a row count rounded up to a multiple of this."""
    return BF16_ROW_MULTIPLE if dtype == torch.bfloat16 and packs(dtype) else 1


def packed_rows(dtype: torch.dtype, min_rows: int = PACKED_MIN_ROWS) -> tuple[int, int]:
    """The row counts (inclusive) for which a packed weight of this dtype is used."""
    if not packs(dtype):
        return _NO_ROWS
    if dtype == torch.bfloat16:
        return _ANY_ROWS
    return min_rows, _float32_packed_max_rows()


def _float32_packed_max_rows() -> int:
    if cpu_vendor() == "GenuineIntel":
        return PACKED_MAX_ROWS_INTEL
    if "avx512f" not in cpu_flags() or not onednn_allows("AVX512_CORE"):
        return PACKED_MAX_ROWS_AVX2
    return _ANY_ROWS[1]


def _small_rows_kernels() -> bool:
    """MESHSERVE_DISABLE_GEMV=1 turns the GEMV and the panels off (the benchmarks' baseline)."""
    return os.environ.get("MESHSERVE_DISABLE_GEMV") != "1"


def panel_max_rows(dtype: torch.dtype) -> int:
    """Up to this many rows a matmul with a CPU weight of this dtype takes its panels
    (csrc/panel_gemm.cpp); 0 where they cannot run now."""
    if not (_small_rows_kernels() and cpu_kernels.panel_usable(dtype)):
        return 0
    if dtype == torch.bfloat16:
        isa = cpu_kernels.panel_bf16_isa()
        if isa == "amx":
            return PANEL_MAX_ROWS_AMX_TILES
        if isa == "avx2":
            return PANEL_MAX_ROWS_AVX2
        return PANEL_MAX_ROWS_AMX if packs(dtype) and cpu_bf16_matmul_isa() == "AMX" else PANEL_MAX_ROWS
    if cpu_kernels.panel_isa() == "avx2":
        return PANEL_MAX_ROWS_AVX2
    return PANEL_MAX_ROWS_INTEL if cpu_vendor() == "GenuineIntel" else PANEL_MAX_ROWS


def gemv_max_rows(dtype: torch.dtype) -> int:
    """Up to this many rows a matmul with a CPU weight of this dtype streams the weight through the
    C++ GEMV (csrc/gemv.cpp) instead of MKL or oneDNN: none where the panels take those rows; to
    the measured crossover with oneDNN where the dtype is packed and the GEMV runs its AVX-512
    path, else to the GEMV's limit. 0: not here, or turned off (_small_rows_kernels)."""
    usable = dtype in cpu_kernels.DTYPES and _small_rows_kernels() and cpu_kernels.available()
    if not usable or panel_max_rows(dtype):
        return 0
    if packs(dtype) and cpu_kernels.gemv_isa() == "avx512":
        return GEMV_MAX_ROWS_BESIDE_PACKED[dtype]
    return cpu_kernels.GEMV_MAX_ROWS


def widens_bf16(weight: torch.Tensor) -> bool:
    """Rows of x that neither the GEMV nor oneDNN takes multiply this weight in float32: a CPU
    bfloat16 weight where oneDNN cannot pack bfloat16 (an AVX2-only CPU). Widening the weight for
    each call costs a pass over it, a few percent of a prefill chunk's multiply (the C++ layer loop,
    csrc/decoder_stack.cpp, applies the same rule to a bfloat16 weight without a packed copy)."""
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and not onednn_packs_bf16()


def _enabled(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and packs(weight.dtype)


class PrepackedMatmul:
    """Mixin for modules holding a `weight` [out, in] used as x @ weight^T."""

    weight: torch.nn.Parameter  # set by the module's __init__ (empty once the weight is quantized)
    _packed: torch.Tensor | None = None
    _panels: torch.Tensor | None = None  # the weight as panel_gemm reads it (cpu_kernels.pack_panels)
    quant: QuantizedMatmul | None = None  # the weight as quantized blocks (quantization/assemble.py)
    packed_min_rows = PACKED_MIN_ROWS
    rows_are_sequences = False  # one row per sequence (an LM head), not one per token
    bias_in_matmul = True  # forward passes its bias to matmul (a row-parallel one adds it after the all-reduce)

    def prepack(self) -> None:
        """Call after the weights are loaded and on their final device and dtype."""
        usable = _enabled(self.weight) and self.quant is None
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach()) if usable else None
        panels = (self.quant is None and self.weight.device.type == "cpu" and self.weight.dim() == 2
                  and panel_max_rows(self.weight.dtype) > 0)
        self._panels = cpu_kernels.pack_panels(self.weight) if panels else None

    def _takes_panels(self, x: torch.Tensor) -> bool:
        return (self._panels is not None and self.quant is None and x.dim() == 2
                and x.shape[0] <= panel_max_rows(self.weight.dtype) and x.dtype == self.weight.dtype)

    def argmax(self, x: torch.Tensor, n: int) -> torch.Tensor | None:
        """Per row of x, the index of the largest of matmul(x)'s first n outputs, where the panels
        find it without writing the outputs (cpu_kernels.panel_argmax); None elsewhere."""
        if self._takes_panels(x) and cpu_kernels.panel_argmax_usable(x.dtype):
            assert self._panels is not None
            return cpu_kernels.panel_argmax(x.contiguous(), self._panels, n)
        return None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.quant is not None:
            return self.quant(x, bias)
        if self._takes_panels(x):
            assert self._panels is not None
            return cpu_kernels.panel_gemm(x.contiguous(), self._panels, self.weight.shape[0], bias)
        if (x.dim() == 2 and x.shape[0] <= gemv_max_rows(self.weight.dtype) and self.weight.device.type == "cpu"
                and x.dtype == self.weight.dtype and self.weight.is_contiguous()):
            return cpu_kernels.gemv(x, self.weight, bias)
        if self._packed is not None and x.dim() == 2:
            lo, hi = packed_rows(self.weight.dtype, self.packed_min_rows)
            rows = x.shape[0]
            if lo <= rows <= hi:
                pad = -rows % row_multiple(self.weight.dtype)
                x = F.pad(x, (0, 0, 0, pad)) if pad else x.contiguous()
                y = torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")
                return y[:rows] if pad else y
        if widens_bf16(self.weight) and x.dtype == torch.bfloat16:
            wide_bias = None if bias is None else bias.float()
            return F.linear(x.float(), self.weight.float(), wide_bias).to(torch.bfloat16)
        return F.linear(x, self.weight, bias)


def prepack_model(model: torch.nn.Module) -> huge_pages.Arena | None:
    """Pack every linear weight of the model (again, after the weights changed); returns the block
    its streamed weights went to (None: not a CPU model)."""
    for m in model.modules():
        if isinstance(m, PrepackedMatmul):
            m.prepack()
    arena = place_streamed_weights(model)
    use_cpu_stack = getattr(model, "use_cpu_stack", None)
    if use_cpu_stack is not None:  # the C++ layer loop holds the packed copies: give it the new ones
        use_cpu_stack()
    return arena


def place_streamed_weights(model: torch.nn.Module) -> huge_pages.Arena | None:
    """Move what a CPU decode step streams (each linear weight as stored, its panels, its quantized
    blocks) into one block of host memory on huge pages, in the order of the layers
    (utils/huge_pages.py); returns the block (None: not a CPU model). oneDNN's packed copies stay
    where they are: opaque tensors, read by prompt steps that are compute-bound anyway."""
    slots: list[tuple[torch.Tensor, Callable[[torch.Tensor], None]]] = []
    for m in model.modules():
        if not isinstance(m, PrepackedMatmul):
            continue
        if m.weight.device.type != "cpu":
            return None
        if m.weight.numel():
            slots.append((m.weight.data, functools.partial(setattr, m.weight, "data")))
        if m._panels is not None:
            slots.append((m._panels, functools.partial(setattr, m, "_panels")))
        for segment in m.quant.segments if m.quant is not None else []:
            if segment.blocks is not None:
                slots.append((segment.blocks.data, functools.partial(setattr, segment.blocks, "data")))
    slots = [(t, put) for t, put in slots if t.is_contiguous()]
    if not slots:
        return None
    arena = huge_pages.Arena([t for t, _ in slots])
    slots.reverse()
    while slots:  # each original goes as soon as its copy is in: never two copies of the weights
        t, put = slots.pop()
        put(arena.move(t))
        del t
    return arena


def panel_bytes(model: torch.nn.Module) -> int:
    """Host memory the model's weight panels take (the copy beside each linear weight)."""
    return sum(m._panels.nbytes for m in model.modules()
               if isinstance(m, PrepackedMatmul) and m._panels is not None)


def warm_up_packed(model: torch.nn.Module, max_token_rows: int, max_sequence_rows: int) -> int:
    """Builds oneDNN's primitives for every padded row count a step can bring up to these bounds,
    once per weight shape (layers of one shape share them); returns how many matmuls that ran.
    Does nothing unless the rows are padded (bfloat16): unpadded row counts are too many to build."""
    seen: set[tuple] = set()
    calls = 0
    for m in model.modules():
        if not isinstance(m, PrepackedMatmul):
            continue
        multiple = row_multiple(m.weight.dtype)
        if multiple == 1 or m._packed is None:
            continue
        bias = getattr(m, "bias", None) if m.bias_in_matmul else None
        key = (tuple(m.weight.shape), m.weight.dtype, bias is not None)
        if key in seen:
            continue
        seen.add(key)
        lo, hi = packed_rows(m.weight.dtype, m.packed_min_rows)
        top = min(hi, max_sequence_rows if m.rows_are_sequences else max_token_rows)
        # fewer rows take the GEMV or the panels, never oneDNN
        first = max(lo, gemv_max_rows(m.weight.dtype) + 1, panel_max_rows(m.weight.dtype) + 1)
        with torch.inference_mode():
            for rows in range(-(-first // multiple) * multiple, top + multiple, multiple):
                m.matmul(torch.zeros(rows, m.weight.shape[1], dtype=m.weight.dtype), bias)
                calls += 1
    return calls
