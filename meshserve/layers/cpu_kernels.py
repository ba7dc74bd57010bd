"""CPU kernels for the float32 and bfloat16 paths, in C++ compiled on first use (sources: csrc/).

- `paged_decode`: decode attention reading K/V straight from the paged cache. The PyTorch path
  gathers every sequence's blocks into a padded copy before SDPA, which on CPU triples the memory
  traffic of attention. One task is one sequence: each cached token's K/V row (all KV heads) is
  read once, as one contiguous run, and serves every query head of its group. In bfloat16 on
  CPUs with AVX512-BF16 the scores are computed from the cache as stored (csrc/paged_decode.cpp),
  on AMX tiles where the CPU has them (16 keys x 16 heads a tile).
  An fp8 cache (float8_e4m3fn or float8_e5m2, --kv-cache-dtype) is read as stored too, each byte
  widened to float32 in registers and times the layer's k_scale / v_scale.
- `rms_norm` (with the residual add fused in), `silu_and_mul` and `rotary_`: one pass over the
  activations each, where the PyTorch formulas make several.
- `gemv`: linear layers for the few rows of a decode step (csrc/gemv.cpp), streaming the weight
  as stored, float32 or bfloat16, at the memory's pace (cpu_gemm.py chooses it by row count).
- `panel_gemm`: linear layers for a few to a few dozen rows (csrc/panel_gemm.cpp) on a copy of the
  weight packed at load time in panels of PANEL_WIDTH outputs (`pack_panels`), the outputs across
  the vector lanes: float32 on AVX-512 or AVX2, bfloat16 with AVX512-BF16.
  `panel_argmax`: a greedy step's tokens from the LM head's panels without writing its logits.
- `qgemv` / `qdequantize`: linear layers on quantized weights as a GGUF file stores them (Q4_0,
  Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K) or as int8 / float8 e4m3 rows with per-channel scales
  (csrc/quant_gemv.cpp): a decode step's few rows read the blocks without expanding them in memory,
  x rounded to int8 per 32 values so that each block meets it in integer dot products (AVX512-VNNI,
  AVX-VNNI or AVX2, chosen at run time; `set_quant_isa` forces one, or the float path); more rows
  take the dequantized weight through the float matmul.
- `prefill_causal`: causal attention of fresh prompts of equal length (csrc/prefill_attention.cpp),
  float32 in registers on AVX2 CPUs (Intel ones with AVX-512 keep SDPA), bfloat16 on AMX tiles.
- `argmax`: the greedy token of each row of logits (a vectorised max, then its first position),
  where torch's argmax runs one scalar pass per row on a CPU.

The extension is built with torch's cpp_extension into the meshserve cache directory and reused
across runs; the build name carries a hash of the source, the compiler flags, the torch and Python
versions and their include paths, so machines with different CPUs, and several Python environments,
can share a cache directory. The engine builds them while it loads the model (before the server
reports ready), never in the middle of a request. When the build
fails (no compiler) or MESHSERVE_DISABLE_CPU_KERNELS=1, `available()` is False and callers keep
the PyTorch path.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

import torch

from meshserve.utils.cpuinfo import cpu_flags

logger = logging.getLogger(__name__)

# One translation unit, in this order: the later files call the earlier ones' kernels and helpers.
_SOURCE_PATHS = [Path(__file__).parent / "csrc" / name for name in
                 ("cpu_kernels.cpp", "gemv.cpp", "quant_gemv.cpp", "amx.cpp", "paged_decode.cpp", "panel_gemm.cpp",
                  "prefill_attention.cpp", "decoder_stack.cpp")]
_FUNCTIONS = ["paged_decode", "rms_norm", "silu_and_mul", "rotary_", "argmax_rows", "gemv", "gemv_isa",
              "decoder_stack", "allow_avx512", "allow_amx", "panel_gemm", "panel_argmax", "panel_argmax_usable",
              "panel_usable", "panel_isa", "panel_bf16_isa",
              "qgemv", "qmatmul", "qdequantize", "quant_isa", "set_quant_isa", "prefill_causal",
              "prefill_causal_usable", "fused_decode_steps"]

_lock = threading.Lock()
_module = None
_tried = False


def _cpu_flags() -> list[str]:
    """AVX2/FMA only when this CPU has them; never -march=native, whose output a machine with
    another CPU sharing the cache directory could not run (the flags are part of the build name)."""
    flags = cpu_flags()
    if not {"avx2", "fma"} <= flags:
        return []
    return ["-mavx2", "-mfma", "-mf16c"] if "f16c" in flags else ["-mavx2", "-mfma"]


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """One build at a time per build directory. torch's own lock there is a file that a build killed
    midway (Ctrl-C, a timeout) leaves behind, and every later start would wait on it forever; this
    lock is the kernel's and dies with its holder, so whoever holds it knows that file is stale."""
    with open(build_dir / "build.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield


def _build():
    import sysconfig

    from torch.utils.cpp_extension import include_paths, load_inline

    from meshserve.utils.paths import cache_dir

    # -fopenmp makes at::parallel_for use torch's OpenMP pool (same libgomp, already loaded).
    # Without trapping math (as torch itself is built) GCC vectorises loops with clamps in them.
    cflags = ["-O3", "-fopenmp", "-fno-trapping-math", "-fno-math-errno", *_cpu_flags()]
    source = "\n".join(path.read_text() for path in _SOURCE_PATHS)
    # Everything that makes two builds differ names the build: two environments sharing one cache
    # directory (a venv and the system Python) must not take turns rebuilding the same module.
    parts = [source, *_FUNCTIONS, *cflags, torch.__version__, sys.version.split()[0], *include_paths(),
             sysconfig.get_paths()["include"]]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    name = f"meshserve_cpu_kernels_{key}"
    build_dir = cache_dir() / "torch_extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        logger.info("building the CPU kernels in %s (once; about a minute)", build_dir)
    with _build_lock(build_dir):
        module = load_inline(name=name, cpp_sources=[source], functions=_FUNCTIONS,
                             extra_cflags=cflags, extra_ldflags=["-fopenmp"], build_directory=str(build_dir))
    logger.info("CPU kernels ready (%s)", name)
    return module


def _reason(e: Exception) -> str:
    """The compiler's own complaint rather than ninja's closing line."""
    lines = [line for line in str(e).strip().splitlines() if line and not line.startswith("ninja:")]
    return lines[-1] if lines else type(e).__name__


def available() -> bool:
    """True when the kernel is compiled (building it on the first call) and not disabled."""
    global _module, _tried
    if os.environ.get("MESHSERVE_DISABLE_CPU_KERNELS") == "1":
        return False
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    _module = _build()
                except Exception as e:  # no compiler, no ninja, failed build: the PyTorch path still works
                    logger.warning("CPU kernels unavailable, using the PyTorch path: %s", _reason(e))
                _tried = True
    return _module is not None


DTYPES = (torch.float32, torch.bfloat16)


def usable(*tensors: torch.Tensor) -> bool:
    """The kernels take CPU tensors of one dtype, float32 or bfloat16 (computed in float32)."""
    dtype = tensors[0].dtype
    return dtype in DTYPES and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors) and available()


FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def decode_usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """paged_decode takes q as `usable` does and a cache of q's dtype or an fp8 one."""
    if k_cache.device.type != "cpu" or k_cache.dtype not in (q.dtype, *FP8_CACHE_DTYPES):
        return False
    return usable(q)


def _kernels():
    if not available():
        raise RuntimeError("the CPU kernels are not available")
    return _module


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """q: [B, H, D]; caches: [num_blocks, block_size, KVH, D]; block_tables: [B, max_blocks];
    context_lens: [B] tokens each sequence attends to (its new token included). Returns [B, H, D].
    bfloat16 with head size 64 or 128 takes the AVX512-BF16 path where the CPU has it. The caches
    are q's dtype, or fp8 (decode_usable) read as stored value x k_scale (keys) / v_scale (values)."""
    return _kernels().paged_decode(q.contiguous(), k_cache.contiguous(), v_cache.contiguous(),
                                   block_tables.to(torch.long).contiguous(),
                                   context_lens.to(torch.long).contiguous(), float(scale), float(k_scale),
                                   float(v_scale))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * x / rms(x) over rows of x [T, H]. With `residual`, normalises x + residual and
    stores that sum into `residual` in place."""
    return _kernels().rms_norm(x, weight, residual, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate, then up) -> silu(gate) * up, [T, I]."""
    return _kernels().silu_and_mul(gate_up)


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
            head_dim: int) -> None:
    """Rotate-half RoPE, in place, on the first `num_heads` heads of each row of x [T, >= num_heads * D]."""
    _kernels().rotary_(x, positions, cos, sin, num_heads, head_dim)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a [rows, V] float32 or bfloat16 tensor (first maximum; first NaN)."""
    return _kernels().argmax_rows(x)


GEMV_MAX_ROWS = 16  # kGemvMaxRows in csrc/gemv.cpp


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for 0 to GEMV_MAX_ROWS rows of x, streaming the weight as stored
    (float32 or bfloat16, [N, K] contiguous); computed in float32, rounded once to x's dtype."""
    return _kernels().gemv(x, weight, bias)


def prefill_usable(q: torch.Tensor, n: int) -> bool:
    """prefill_causal takes these heads ([n * L, heads, head_dim]) of n prompts on this CPU, prompts
    up to 2,048 tokens: float32 built with AVX2, head size a multiple of 8, except on an Intel CPU with
    AVX-512 taken (there PyTorch's own kernel runs its AVX-512 path at full width, not measured against
    this); bfloat16 on AMX-BF16, head size 32 to 128 in steps of 32 (csrc/prefill_attention.cpp)."""
    return q.device.type == "cpu" and available() and _kernels().prefill_causal_usable(q, n)


def prefill_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int) -> torch.Tensor:
    """Causal attention of n fresh prompts of equal length packed back to back: q [n*L, H, D],
    k, v [n*L, KVH, D] (each token's heads contiguous; rows may be strided) -> [n*L, H, D]."""
    return _kernels().prefill_causal(q, k, v, n)


def gemv_isa() -> str:
    """The compiled path gemv takes now: "avx512" or "avx2" (the build's baseline)."""
    return _kernels().gemv_isa()


PANEL_WIDTH = 48  # kPanelWidth in csrc/panel_gemm.cpp
PANEL_TILE_MIN_ROWS = 9  # kAmxMinRows: bfloat16 from this many rows on takes AMX tiles where it can


def panel_usable(dtype: torch.dtype) -> bool:
    """panel_gemm runs on this CPU now for this dtype (float32: AVX-512 or AVX2; bfloat16: AVX512-BF16,
    or widened to float32 in registers on AVX2)."""
    return dtype in DTYPES and available() and _kernels().panel_usable(dtype == torch.bfloat16)


def panel_argmax_usable(dtype: torch.dtype) -> bool:
    """panel_argmax runs on this CPU now for this dtype (float32: AVX-512; bfloat16: AVX512-BF16)."""
    return dtype in DTYPES and available() and _kernels().panel_argmax_usable(dtype == torch.bfloat16)


def panel_isa() -> str:
    """The kernel panel_gemm takes now for float32: "avx512", "avx2", or "" (none on this CPU)."""
    return _kernels().panel_isa()


def panel_bf16_isa() -> str:
    """The kernel panel_gemm takes for bfloat16 from PANEL_TILE_MIN_ROWS rows on: "amx" (tiles),
    "avx512_bf16" (register blocks, as for fewer rows), "avx2" (widened in registers, every row
    count), or "" (none on this CPU)."""
    return _kernels().panel_bf16_isa()


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] as panel_gemm reads it: panels of PANEL_WIDTH outputs, K-major ([P, K, 48] in
    float32; bfloat16 keeps neighbours along K in pairs, [P, ceil(K/2), 48, 2]); rows past N zero."""
    n, k = weight.shape
    w = torch.nn.functional.pad(weight.detach(), (0, k % 2 if weight.dtype == torch.bfloat16 else 0,
                                                  0, -n % PANEL_WIDTH))
    p = w.shape[0] // PANEL_WIDTH
    if weight.dtype == torch.bfloat16:
        return w.view(p, PANEL_WIDTH, w.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()
    return w.view(p, PANEL_WIDTH, k).transpose(1, 2).contiguous()


def panel_gemm(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for any number of rows of x, panels = pack_panels(weight), n = the
    weight's rows; float32 sums, rounded once to x's dtype."""
    return _kernels().panel_gemm(x, panels, n, bias)


def panel_argmax(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """argmax(panel_gemm(x, panels, n, bias)) per row (int64; the first of equal maxima, the first
    NaN) without the [rows, n] outputs: a greedy step's LM head. n may be fewer than the panels'
    outputs (the first n: a padded vocabulary)."""
    return _kernels().panel_argmax(x, panels, n, bias)


def allow_avx512(allowed: bool) -> bool:
    """Whether the kernels may take their AVX-512 paths where the CPU has them (the default); the
    tests turn it off to check the AVX2 paths on such a CPU. Returns the previous setting."""
    return _kernels().allow_avx512(allowed)


def allow_amx(allowed: bool) -> bool:
    """Whether panel_gemm and bfloat16 decode attention may take AMX tiles where the CPU has them
    (the default); the tests turn it off to check the AVX512-BF16 paths on such a CPU. Returns the
    previous setting."""
    return _kernels().allow_amx(allowed)


def qgemv(x: torch.Tensor, data: torch.Tensor, block_type: int, row_scale: torch.Tensor | None = None,
          bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, dequantized weight, bias) for 0 to GEMV_MAX_ROWS rows of x (float32 or bfloat16),
    reading the weight's quantized blocks as stored (csrc/quant_gemv.cpp; `data`: [N, row_bytes]
    uint8; `row_scale`: float32 [N], for int8 and fp8 rows only).

    On the integer paths (`quant_isa()`; every block type but fp8 rows) x is first rounded per run
    of 32 values to int8 with the scale max|x| / 127, and the result is the product of the
    dequantized weight with that rounded x: within ~1% of the exact product, as llama.cpp computes
    it. On the float path it is the float32 product up to summation order."""
    return _kernels().qgemv(x, data, block_type, row_scale, bias)


def qmatmul(x: torch.Tensor, data: torch.Tensor, block_type: int, row_scale: torch.Tensor | None = None,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """qgemv for any number of rows: on the integer paths the same kernels tile every row count
    (prefill included, without a float copy of the weight); on the float path more than
    GEMV_MAX_ROWS rows take the float matmul of the dequantized weight."""
    return _kernels().qmatmul(x, data, block_type, row_scale, bias)


def quant_isa() -> str:
    """The path qgemv takes now for GGUF blocks and int8 rows: "vnni512", "avx512", "avxvnni", "avx2"
    (integer dot products; fp8 rows always take the float path) or "float"."""
    return _kernels().quant_isa()


def set_quant_isa(name: str) -> str:
    """Forces qgemv's path ("vnni512", "avx512", "avxvnni", "avx2", "float"; "auto" for the best this
    CPU has, the default); RuntimeError for a path the CPU lacks. Returns the previous setting."""
    return _kernels().set_quant_isa(name)


def qdequantize(data: torch.Tensor, block_type: int, k: int, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 [N, k] weight that quantized blocks `data` ([N, row_bytes] uint8) stand for."""
    return _kernels().qdequantize(data, block_type, k, row_scale)


def decoder_stack(*args):
    """A stage's dense decoder layers in one call; see cpu_decoder_stack.CPUDecoderStack."""
    return _kernels().decoder_stack(*args)


def fused_decode_steps() -> int:
    """How many decode steps decoder_stack ran in one parallel region (all layers, the weight
    panels) since the process started."""
    return _kernels().fused_decode_steps() if available() else 0
