"""The Triton attention tiles fit in shared memory: every tile the launcher can pick (prefill and
decode, every group size, head_dim, compute dtype and cache dtype) has a static estimate under
200 KB; float32 on head_dim 128 takes narrower key tiles and fewer pipeline stages than 16-bit;
the launcher passes the fitted tile. And the bf16 check of dtype="auto" works on older torch."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: CPU tensors, no GPU

import contextlib

import pytest
import torch

from meshserve import config
from meshserve.layers import paged_launch
from meshserve.layers.paged_launch import (
    SHARED_MEMORY_BUDGET,
    decode_tile,
    fit_shared_memory,
    next_power_of_2,
    prefill_tile,
    shared_memory_bytes,
)

LIMIT = 200 * 1024
HEAD_DIMS = (32, 64, 80, 96, 128, 256)
GROUPS = (1, 2, 3, 4, 5, 7, 8, 16, 32)


@pytest.mark.parametrize("q_bytes,kv_bytes", [(4, 4), (2, 2), (2, 1), (4, 1)])
def test_every_tile_the_launcher_can_pick_fits(q_bytes, kv_bytes):
    for head_dim in HEAD_DIMS:
        head_dim_p = max(16, next_power_of_2(head_dim))
        for group in GROUPS:
            for tile in (prefill_tile(group), decode_tile(group)):
                fitted = fit_shared_memory(tile, head_dim_p, q_bytes, kv_bytes)
                used = shared_memory_bytes(fitted, head_dim_p, q_bytes, kv_bytes)
                assert used <= SHARED_MEMORY_BUDGET < LIMIT, (head_dim, group, fitted, used)
                assert fitted.block_n >= paged_launch.MIN_DOT and fitted.num_stages >= 1


def test_float32_on_head_dim_128_takes_smaller_tiles():
    tile = prefill_tile(4)
    assert shared_memory_bytes(tile, 128, 4, 4) > LIMIT  # the 16-bit tile in float32 would not fit
    fp32 = fit_shared_memory(tile, 128, 4, 4)
    assert (fp32.block_n, fp32.num_stages) == (32, 2)
    bf16 = fit_shared_memory(tile, 128, 2, 2)
    assert (bf16.block_n, bf16.num_stages) == (64, 3)


def test_the_launcher_passes_the_fitted_tile():
    from meshserve.layers import triton_attention

    for dtype, expected in ((torch.float32, (32, 2)), (torch.float16, (64, 3))):
        q = torch.zeros(3, 8, 128, dtype=dtype)
        cache = torch.zeros(4, 16, 2, 128, dtype=dtype)
        _, _, consts = triton_attention._common_args(q, cache, cache, 1.0, 8, prefill_tile(4), 1.0, 1.0, None)
        assert (consts["BLOCK_N"], consts["num_stages"]) == expected


@pytest.mark.parametrize("major,expected", [(7, False), (8, True), (9, True)])
def test_bf16_check_without_including_emulation(monkeypatch, major, expected):
    """torch before including_emulation existed: the native capability decides."""
    def old_is_bf16_supported():
        return True

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", old_is_bf16_supported)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    assert config._cuda_bf16_supported(torch.device("cuda", 0)) is expected
