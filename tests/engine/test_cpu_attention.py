"""The CPU paged decode kernel equals the PyTorch gather + SDPA path, and the decode hook falls
back to that path when the kernel is disabled, unavailable or given tensors it does not handle."""
import logging

import pytest
import torch

from meshserve.layers import cpu_attention
from meshserve.layers.attention import AttentionMetadata, PagedAttention

BLOCK = 16
HEAD_DIM = 64


def _case(lens, heads, kv_heads, table_kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = -(-max(lens) // BLOCK) + 1  # one spare column: tables are padded past the longest sequence
    num_blocks = len(lens) * width + 3
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, HEAD_DIM, generator=g)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, HEAD_DIM, generator=g)
    if table_kind == "scattered":
        tables = torch.randperm(num_blocks, generator=g)[:len(lens) * width].view(len(lens), width)
    elif table_kind == "shared_prefix":  # every sequence starts with the same two blocks, as after a prefix hit
        tables = torch.randperm(num_blocks, generator=g)[:len(lens) * width].view(len(lens), width)
        tables[:, :2] = tables[0, :2]
    else:  # "padded": blocks past each sequence's length are 0, as the model runner pads them
        tables = torch.arange(len(lens) * width).view(len(lens), width)
        for i, n in enumerate(lens):
            tables[i, -(-n // BLOCK):] = 0
    lens_t = torch.tensor(lens)
    mask = (torch.arange(width * BLOCK)[None, :] < lens_t[:, None])[:, None, None, :]
    q = torch.randn(len(lens), heads, HEAD_DIM, generator=g)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), [], 0, tables, mask)
    return q, k_cache, v_cache, meta, lens_t


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_attention.available(), "the C++ kernel must build here (g++ and ninja are installed)"


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2)])  # GQA ratios 1, 3 and 4
@pytest.mark.parametrize("table_kind", ["scattered", "shared_prefix", "padded"])
def test_kernel_equals_pytorch_path(heads, kv_heads, table_kind):
    lens = [1, 2, 15, 16, 17, 32, 33, 47, 100, 321]  # single token, either side of block boundaries, long
    q, k_cache, v_cache, meta, lens_t = _case(lens, heads, kv_heads, table_kind, seed=heads + kv_heads)
    attn = PagedAttention(heads, kv_heads, HEAD_DIM)
    expected = attn._decode_torch(q, k_cache, v_cache, meta)
    got = cpu_attention.paged_decode(q, k_cache, v_cache, meta.decode_block_tables, lens_t, HEAD_DIM ** -0.5)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-5
    # A single-token context attends to exactly its own V row.
    first_block = meta.decode_block_tables[0, 0]
    torch.testing.assert_close(got[0], v_cache[first_block, 0].repeat_interleave(heads // kv_heads, dim=0))


def test_decode_hook_uses_kernel_and_accepts_strided_inputs(monkeypatch):
    q, k_cache, v_cache, meta, _ = _case([5, 40, 200], 9, 3, "scattered")
    attn = PagedAttention(9, 3, HEAD_DIM)
    expected = attn._decode_torch(q, k_cache, v_cache, meta)
    calls = []
    real = cpu_attention.paged_decode
    monkeypatch.setattr(cpu_attention, "paged_decode", lambda *a: calls.append(1) or real(*a))
    wide = torch.cat([torch.zeros_like(q), q], dim=-1)[..., HEAD_DIM:]  # non-contiguous view, as after a split
    meta.decode_block_tables = meta.decode_block_tables.to(torch.int32)
    got = attn._decode(wide, k_cache, v_cache, meta)
    assert calls == [1]
    assert (got - expected).abs().max().item() < 1e-5


def test_env_var_forces_pytorch_path(monkeypatch):
    q, k_cache, v_cache, meta, _ = _case([3, 30], 9, 3, "padded")
    monkeypatch.setenv("MESHSERVE_DISABLE_CPU_KERNELS", "1")
    monkeypatch.setattr(cpu_attention, "paged_decode", lambda *a: pytest.fail("kernel used while disabled"))
    attn = PagedAttention(9, 3, HEAD_DIM)
    assert not cpu_attention.usable(q, k_cache)
    torch.testing.assert_close(attn._decode(q, k_cache, v_cache, meta), attn._decode_torch(q, k_cache, v_cache, meta))


def test_other_dtypes_keep_pytorch_path():
    q, k_cache, _, _, _ = _case([3], 9, 3, "padded")
    assert cpu_attention.usable(q, k_cache)
    assert not cpu_attention.usable(q.bfloat16(), k_cache.bfloat16())
    assert not cpu_attention.usable(q.double(), k_cache.double())


def test_failed_build_warns_once_and_falls_back(monkeypatch, caplog):
    def no_compiler():
        raise RuntimeError("Error building extension\nc++: command not found")

    monkeypatch.setattr(cpu_attention, "_build", no_compiler)
    monkeypatch.setattr(cpu_attention, "_module", None)
    monkeypatch.setattr(cpu_attention, "_tried", False)
    q, k_cache, v_cache, meta, _ = _case([3, 30], 9, 3, "padded")
    attn = PagedAttention(9, 3, HEAD_DIM)
    with caplog.at_level(logging.WARNING, logger=cpu_attention.__name__):
        out = attn._decode(q, k_cache, v_cache, meta)
        attn._decode(q, k_cache, v_cache, meta)
    torch.testing.assert_close(out, attn._decode_torch(q, k_cache, v_cache, meta))
    warnings = [r for r in caplog.records if r.name == cpu_attention.__name__]
    assert len(warnings) == 1 and "command not found" in warnings[0].getMessage()


def test_out_of_range_inputs_raise_instead_of_reading_past_the_cache():
    q, k_cache, v_cache, meta, lens = _case([20], 9, 3, "padded")
    too_long = torch.tensor([meta.decode_block_tables.shape[1] * BLOCK + 1])
    with pytest.raises(RuntimeError, match="context length"):
        cpu_attention.paged_decode(q, k_cache, v_cache, meta.decode_block_tables, too_long, 0.125)
    bad_table = meta.decode_block_tables.clone()
    bad_table[0, 1] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="block id"):
        cpu_attention.paged_decode(q, k_cache, v_cache, bad_table, lens, 0.125)
