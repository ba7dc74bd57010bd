"""KV-cache blocks out of and into a replica through its executor (worker/kv_blocks.py): the exported
tensor is the cache's contents in one layout whatever the TP/PP that holds them, and an import
followed by an export gives the same bytes back, across layouts and for an fp8 cache too.

Engines of different layouts compute K/V with float32 sums in different orders (TP's all-reduce),
so their own blocks are compared within rounding; every round trip is compared bit for bit.
"""
from __future__ import annotations

import functools
import pickle
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from parallel_helpers import ENGINE_ARGS, GREEDY, make_tiny_model, prompts

from meshserve import LLM
from meshserve.worker.kv_blocks import KVLayout, KVPart, WireTensor, assemble
from meshserve.worker.rank_messages import RankMethod

ROUNDING = dict(rtol=1e-5, atol=1e-6)  # float32 K/V of two layouts of the same weights


@contextmanager
def engine(model: str, **kwargs):
    llm = LLM(model, **ENGINE_ARGS, **kwargs)
    try:
        yield llm
    finally:
        llm.engine.shutdown()


def written_blocks(caches: list[torch.Tensor]) -> list[int]:
    first = caches[0]
    return [b for b in range(first.shape[1]) if bool(first[:, b].float().abs().sum() > 0)]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def free_blocks(n: int, start: int = 300) -> list[int]:
    """Ids far past what the prompts use (every engine here has >= 512 blocks), in a scrambled order."""
    return [start + (7 * i) % (2 * n + 1) for i in range(n)]


@dataclass
class Reference:
    llm: LLM
    used: list[int]  # the blocks the prompts wrote
    full: torch.Tensor  # their export


@pytest.fixture(scope="module")
def reference(tiny_kv2):
    """A single-rank float32 engine after the prompts, kept up for the tests that read its cache."""
    with engine(tiny_kv2) as llm:
        llm.generate(prompts(), GREEDY)
        used = written_blocks(llm.engine.executor.runner.kv_caches)
        assert len(used) >= 6
        yield Reference(llm, used, llm.engine.executor.export_kv(used))


def test_export_is_the_cache_and_an_import_exports_the_same_bytes(tiny_kv2, reference):
    executor = reference.llm.engine.executor
    caches = executor.runner.kv_caches
    full = reference.full
    assert executor.kv_layout() == KVLayout(4, 2, 8, 16, "float32")
    assert full.shape == (4, 2, len(reference.used), 16, 2, 8) and full.device.type == "cpu"
    assert full.is_contiguous()
    assert torch.equal(full, torch.stack([c[:, reference.used] for c in caches]))
    order = reference.used[::-1]  # the blocks come out in the order asked
    assert torch.equal(executor.export_kv(order), full.flip(2))
    assert executor.export_kv([]).shape == (4, 2, 0, 16, 2, 8)

    dst = free_blocks(len(reference.used))
    with engine(tiny_kv2) as second:
        ex = second.engine.executor
        ex.import_kv(dst, full)
        assert same_bytes(ex.export_kv(dst), full)
        others = [b for b in range(ex.runner.kv_caches[0].shape[1]) if b not in dst]
        assert all(not bool(c[:, others].abs().sum()) for c in ex.runner.kv_caches)  # nothing else written


def test_bad_ids_and_tensors_are_refused_before_any_rank_sees_them(reference):
    executor = reference.llm.engine.executor
    full, used = reference.full, reference.used
    n = executor.kv_blocks_allocated
    with pytest.raises(ValueError, match="outside"):
        executor.export_kv([0, n])
    with pytest.raises(ValueError, match="distinct"):
        executor.import_kv([1, 1] + used[2:], full)
    with pytest.raises(ValueError, match="do not fit"):
        executor.import_kv(used[:-1], full)
    with pytest.raises(ValueError, match="do not fit"):
        executor.import_kv(used, full.to(torch.bfloat16))
    other = KVLayout(4, 2, 8, 16, "bfloat16")
    assert executor.kv_layout().mismatch(other) == "kv_dtype float32 vs bfloat16"
    assert executor.kv_layout().mismatch(executor.kv_layout()) is None


def test_tp2_holds_the_same_blocks_and_round_trips_them(tiny_kv2, reference):
    full, used = reference.full, reference.used
    with engine(tiny_kv2, tensor_parallel_size=2) as llm:
        ex = llm.engine.executor
        assert [i["num_kv_heads"] for i in ex.infos] == [1, 1]
        assert ex.kv_layout() == reference.llm.engine.executor.kv_layout()
        llm.generate(prompts(), GREEDY)
        torch.testing.assert_close(ex.export_kv(used), full, **ROUNDING)  # each rank's head in its place
        dst = free_blocks(len(used))
        ex.import_kv(dst, full)
        assert same_bytes(ex.export_kv(dst), full)


def test_pp2_export_equals_the_single_rank_one(tiny_kv2, reference):
    full, used = reference.full, reference.used
    with engine(tiny_kv2, pipeline_parallel_size=2) as llm:
        ex = llm.engine.executor
        assert [i["layers"] for i in ex.infos] == [[0, 1], [2, 3]]
        llm.generate(prompts(), GREEDY)
        torch.testing.assert_close(ex.export_kv(used), full, **ROUNDING)
        dst = free_blocks(len(used))
        ex.import_kv(dst, full)
        assert same_bytes(ex.export_kv(dst), full)


def test_kv_heads_replicated_over_tp_ranks(tmp_path_factory):
    """One KV head, TP=2: both ranks hold it; the export has it once, an import gives it to both."""
    model = str(make_tiny_model(tmp_path_factory.mktemp("tiny_kv1"), 1, 2))
    with engine(model) as llm:
        llm.generate(prompts(), GREEDY)
        used = written_blocks(llm.engine.executor.runner.kv_caches)
        full = llm.engine.executor.export_kv(used)
    assert full.shape == (2, 2, len(used), 16, 1, 8)
    with engine(model, tensor_parallel_size=2) as llm:
        ex = llm.engine.executor
        assert [i["num_kv_heads"] for i in ex.infos] == [1, 1]
        llm.generate(prompts(), GREEDY)
        torch.testing.assert_close(ex.export_kv(used), full, **ROUNDING)
        dst = free_blocks(len(used))
        ex.import_kv(dst, full)
        parts = ex._call_all(RankMethod.EXPORT_KV, dst)  # what each rank holds, before assembly
        assert [(p.layer_start, p.head_start) for p in parts] == [(0, 0), (0, 0)]
        assert all(same_bytes(p.data, full) for p in parts)
        assert same_bytes(ex.export_kv(dst), full)


def test_fp8_cache_round_trips_bit_for_bit(tiny_kv2):
    with engine(tiny_kv2, kv_cache_dtype="fp8") as llm:
        ex = llm.engine.executor
        assert ex.kv_layout().kv_dtype == "float8_e4m3fn"
        llm.generate(prompts(), GREEDY)
        used = written_blocks(ex.runner.kv_caches)
        full = ex.export_kv(used)
        assert full.dtype == torch.float8_e4m3fn
        assert same_bytes(full, torch.stack([c[:, used] for c in ex.runner.kv_caches]))
    with engine(tiny_kv2, kv_cache_dtype="fp8", tensor_parallel_size=2) as llm:  # fp8 through the pipes
        ex = llm.engine.executor
        dst = free_blocks(len(used))
        ex.import_kv(dst, full)
        assert same_bytes(ex.export_kv(dst), full)


# ---- no engine -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_wire_forms_carry_the_raw_bytes(dtype):
    """torch's own pickling of a float8 storage does not load back, and multiprocessing's would move
    tensors through shared memory: the parts and the imported tensor travel as their bytes."""
    data = torch.randn(3, 2, 5, 4, 2, 8).to(dtype)
    part = KVPart(1, 2, data)
    for dumps in (pickle.dumps, ForkingPickler.dumps, functools.partial(pickle.dumps, protocol=5)):
        blob = dumps(part)
        assert len(blob) < data.numel() * data.element_size() + 400  # the bytes, once, and little else
        back = pickle.loads(blob)
        assert (back.layer_start, back.head_start) == (1, 2) and same_bytes(back.data, data)
        assert same_bytes(pickle.loads(dumps(WireTensor(data))).tensor, data)
    empty = pickle.loads(pickle.dumps(KVPart(0, 0, data[:, :, :0])))
    assert empty.data.shape == (3, 2, 0, 4, 2, 8) and empty.data.dtype == dtype


def test_assemble_places_boxes_once_and_refuses_gaps_and_overlaps():
    full = torch.randn(4, 2, 3, 16, 4, 8)

    def part(l0, l1, h0, h1):
        return KVPart(l0, h0, full[l0:l1, :, :, :, h0:h1].contiguous())

    # PP=2 x TP=4 over 2 KV heads: each head on two ranks of each stage
    parts = [part(l0, l1, h, h + 2) for l0, l1 in ((0, 1), (1, 4)) for h in (0, 0, 2, 2)]
    assert torch.equal(assemble(parts, 4, 4), full)
    whole = part(0, 4, 0, 4)
    assert assemble([whole], 4, 4) is whole.data  # a single rank's part already is the whole tensor
    with pytest.raises(ValueError, match="uncovered"):
        assemble(parts[:-2], 4, 4)
    with pytest.raises(ValueError, match="overlaps"):
        assemble([*parts, part(0, 2, 0, 2)], 4, 4)
    with pytest.raises(ValueError, match="overlaps"):
        assemble([part(0, 2, 0, 2), *parts], 4, 4)
    with pytest.raises(ValueError, match="does not fit"):
        assemble([part(0, 4, 0, 4)], 3, 4)
