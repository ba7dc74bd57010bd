"""utils/huge_pages.py, and the CPU runner's use of it: the linear weights as stored and their panels,
what a decode step streams, live in one block advised onto transparent huge pages, in layer order,
their values and ties unchanged; each layer's KV cache, from one huge page on, is advised too."""
from __future__ import annotations

import pytest
import torch
from tiny_model import tiny_runner

from meshserve.layers.cpu_gemm import PrepackedMatmul, prepack_model
from meshserve.utils import huge_pages
from meshserve.utils.huge_pages import HUGE_PAGE_BYTES, Arena

ADVISED = huge_pages.thp_mode() in ("always", "madvise")


def _advised(address: int) -> bool:
    """Whether the mapping holding `address` carries MADV_HUGEPAGE ("hg" in its VmFlags)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_thp_mode_reads_the_bracketed_setting(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "_THP_SETTING", setting)
    huge_pages.thp_mode.cache_clear()
    try:
        assert huge_pages.thp_mode() == "madvise"
        setting.unlink()
        huge_pages.thp_mode.cache_clear()
        assert huge_pages.thp_mode() == ""
    finally:
        huge_pages.thp_mode.cache_clear()


@pytest.mark.parametrize("nbytes", [1, 4096, 3 << 20])
def test_empty_starts_on_a_huge_page_and_is_advised_where_the_kernel_offers_them(nbytes):
    block, huge = huge_pages.empty(nbytes)
    assert block.dtype == torch.uint8 and block.numel() == nbytes
    assert block.data_ptr() % HUGE_PAGE_BYTES == 0
    assert huge == ADVISED
    if ADVISED:
        assert _advised(block.data_ptr()) and _advised(block.data_ptr() + nbytes - 1)


def test_zeros_is_a_zeroed_tensor_of_the_shape_and_dtype():
    t = huge_pages.zeros((3, 5, 7), torch.bfloat16)
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0 and not t.any()
    t.fill_(2.0)  # writable, and nothing else shares it
    assert t.sum().item() == 2 * 105


def test_arena_copies_in_order_once_per_storage():
    a = torch.randn(5, 7)
    b = torch.randn(3, dtype=torch.float64).to(torch.bfloat16)
    c = torch.arange(10, dtype=torch.uint8)
    arena = Arena([a, b, a, c])
    moved = [arena.move(t) for t in (a, b, a, c)]
    for original, copy in zip((a, b, a, c), moved):
        assert copy.dtype == original.dtype and copy.shape == original.shape and torch.equal(copy, original)
        assert copy.untyped_storage().data_ptr() == arena.block.untyped_storage().data_ptr()
        assert copy.data_ptr() % 64 == 0
    assert moved[0].data_ptr() == moved[2].data_ptr()  # a tied tensor stays one tensor
    assert moved[0].data_ptr() < moved[1].data_ptr() < moved[3].data_ptr()
    assert arena.nbytes == 192 + 64 + 64  # a (140 bytes), b, c: each from a cache line
    a.fill_(0.0)
    assert moved[0].abs().sum() > 0  # copies, not views of the originals


def _streamed(model) -> list[torch.Tensor]:
    out = []
    for m in model.modules():
        if isinstance(m, PrepackedMatmul):
            out += [m.weight] + ([m._panels] if m._panels is not None else [])
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_runner_streams_its_weights_from_one_huge_page_block(tmp_path, dtype):
    runner = tiny_runner(tmp_path, dtype=dtype, config={"tie_word_embeddings": True})
    model = runner.model
    streamed = _streamed(model)
    storages = {t.untyped_storage().data_ptr() for t in streamed}
    assert len(storages) == 1  # one block
    starts = [t.data_ptr() for t in streamed if t is not model.lm_head.weight]
    assert starts == sorted(starts)  # in the order the layers read them
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()  # still tied
    if ADVISED:
        assert _advised(streamed[0].data_ptr()) and _advised(streamed[-1].data_ptr())


def test_repacking_moves_the_new_weights_into_a_new_block(tmp_path):
    runner = tiny_runner(tmp_path)
    model = runner.model
    before = model.layers["0"].mlp.down_proj.weight.detach().clone()
    old = model.layers["0"].mlp.down_proj.weight.untyped_storage().data_ptr()
    model.layers["0"].mlp.down_proj.weight.data.mul_(2.0)
    arena = prepack_model(model)
    assert arena is not None and arena.nbytes > 0
    w = model.layers["0"].mlp.down_proj.weight
    assert torch.equal(w, before * 2.0)
    assert w.untyped_storage().data_ptr() == arena.block.untyped_storage().data_ptr() != old


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_the_runner_zeroes_each_layers_kv_cache_on_huge_pages_from_one_huge_page_on(tmp_path, monkeypatch,
                                                                                   kv_cache_dtype):
    runner = tiny_runner(tmp_path, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
    on_huge_pages = []
    zeros = huge_pages.zeros
    monkeypatch.setattr(huge_pages, "zeros", lambda shape, dtype: on_huge_pages.append(shape) or zeros(shape, dtype))
    layer_block = runner.block_bytes // len(runner.model.layers)  # one block's K and V in one layer
    for blocks, huge in [(HUGE_PAGE_BYTES // layer_block + 1, True), (2, False)]:
        on_huge_pages.clear()
        runner.init_kv_cache(blocks)
        assert len(on_huge_pages) == (len(runner.model.layers) if huge else 0)
        for cache in runner.kv_caches:
            assert cache.dtype == runner.kv_dtype and cache.shape[1] == blocks and not cache.float().any()
            if huge:  # (a small cache may land in heap memory that was advised before: not checked)
                assert cache.data_ptr() % HUGE_PAGE_BYTES == 0
                assert _advised(cache.data_ptr()) or not ADVISED
