"""oneDNN's instruction-set levels, each forced with ONEDNN_MAX_CPU_ISA in a process of its own (oneDNN
reads the cap once): dtype=auto, whether bfloat16 weights are packed, and the oneDNN implementation
a packed bfloat16 linear layer runs all follow the cap, and every level multiplies correctly."""
import json
import os
import subprocess
import sys

import pytest

from meshserve.utils.cpuinfo import cpu_flags

_PROBE = r"""
import json, torch
from meshserve.config import auto_dtype
from meshserve.layers import cpu_gemm
from meshserve.layers.linear import ColumnParallelLinear

g = torch.Generator().manual_seed(0)
lin = ColumnParallelLinear(96, 200, bias=True)
lin.weight.data = torch.randn(200, 96, generator=g).bfloat16()
lin.bias.data = torch.randn(200, generator=g).bfloat16()
lin.prepack()
rows = max(cpu_gemm.panel_max_rows(torch.bfloat16), cpu_gemm.gemv_max_rows(torch.bfloat16)) + 20
x = torch.randn(rows, 96, generator=g).bfloat16()  # past the GEMV and the panels: oneDNN's rows
out = lin(x)
ref = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())
print("RESULT " + json.dumps({"auto": auto_dtype("cpu", False), "packed": lin._packed is not None,
                              "err": ((out.float() - ref).abs() / ref.abs().clamp_min(1)).max().item(),
                              "dtype": str(out.dtype)}))
"""

_AMX = {"amx_bf16", "amx_tile", "avx512bw", "avx512vl", "avx512dq"}
_BF16 = {"avx512_bf16", "avx512bw", "avx512vl", "avx512dq"}
_AVX512 = {"avx512bw", "avx512vl", "avx512dq"}

# cap, the flags it needs to mean anything here, then what follows: auto's dtype and the ISA named
# in its reason, whether bf16 weights are packed, and the oneDNN implementation of their matmul
LEVELS = [
    ("AVX512_CORE_AMX", _AMX, ("bfloat16", "AMX"), True, "amx"),
    ("AVX512_CORE_BF16", _BF16, ("bfloat16", "AVX512-BF16"), True, "brg_matmul:avx512_core_bf16"),
    ("AVX512_CORE", _AVX512, ("float32", "without AVX512-BF16"), True, "gemm:jit"),
    ("AVX2", {"avx2", "fma"}, ("float32", "without AVX512-BF16"), False, None),
]


def _run(cap: str) -> tuple[dict, list[str]]:
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": cap, "ONEDNN_VERBOSE": "1"}
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    result = json.loads(next(line for line in lines if line.startswith("RESULT "))[len("RESULT "):])
    matmuls = [line for line in lines if line.startswith("onednn_verbose") and ",exec," in line
               and ("inner_product" in line or "matmul" in line)]
    return result, matmuls


@pytest.mark.parametrize("cap,needs,auto,packed,impl", LEVELS, ids=[level[0] for level in LEVELS])
def test_each_onednn_level_chooses_and_multiplies_bf16_correctly(cap, needs, auto, packed, impl):
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU has no {cap} level")
    result, matmuls = _run(cap)
    (dtype, why), want_dtype, want_reason = result["auto"], *auto
    assert dtype == want_dtype and want_reason in why, (cap, result["auto"])
    assert result["packed"] == packed
    assert result["dtype"] == "torch.bfloat16"
    assert result["err"] <= 2 ** -7  # within one bfloat16 step of the float32 product
    if impl is None:  # bf16 weights widened to float32 past the GEMV: no oneDNN bf16 primitive at all
        assert not any("bf16" in line for line in matmuls), matmuls
    else:
        assert matmuls and all(impl in line for line in matmuls), matmuls
        assert cap.endswith("AMX") or not any("amx" in line for line in matmuls)
