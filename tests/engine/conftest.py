"""Fixtures the engine's kernel tests share."""
import pytest

from meshserve.layers import cpu_kernels


@pytest.fixture(params=["avx512", "avx2"])
def isa(request):
    """Runs a test on the kernels' AVX-512 paths (where this CPU has them) and on the AVX2 ones."""
    previous = cpu_kernels.allow_avx512(request.param == "avx512")
    yield request.param
    cpu_kernels.allow_avx512(previous)
