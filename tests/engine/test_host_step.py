"""The host side of a decode step stays O(batch): at batch 64 and 4k context the Triton backend
sends a step's scalars and only the block-table entries that changed (none when no sequence
crossed into a new block, one per sequence that did), where sending whole tables costs batch x
blocks. Counted in elements staged and entries written, never in time. The persistent tables
equal what whole tables would hold, over randomized joins, finishes, reorders and growth."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the backend imports its kernels (not run here)

import random

import torch

from meshserve.layers.attention import AttentionSpec, create_backend
from meshserve.layers.host_to_device import BlockTableRows
from meshserve.worker.step import SeqStep, StepInput
from meshserve.worker.step_packing import pack_step

CPU = torch.device("cpu")
BLOCK = 16
BATCH, CONTEXT = 64, 4096


def _decode_step(contexts: list[int], tables: list[list[int]]) -> StepInput:
    return StepInput([SeqStep(i, [7], n - 1, t, sample=True) for i, (n, t) in enumerate(zip(contexts, tables))])


def _backend(incremental: bool):
    backend = create_backend("triton", AttentionSpec(8, 2, BLOCK), CPU)
    backend.incremental_tables = incremental
    return backend


def test_a_decode_step_stages_o_batch_elements_at_4k_context():
    # Contexts staggered so that sequences cross block boundaries on different steps.
    contexts = [CONTEXT - BLOCK + 1 + i % BLOCK for i in range(BATCH)]
    blocks = CONTEXT // BLOCK
    tables = [list(range(i * (blocks + 1), i * (blocks + 1) + blocks)) for i in range(BATCH)]
    incremental, baseline = _backend(True), _backend(False)
    for backend in (incremental, baseline):
        backend.build_inputs(pack_step(_decode_step(contexts, tables), BLOCK))  # the first step sends it all
    assert incremental.decode_tables.values_written == BATCH * blocks

    for _ in range(2 * BLOCK):
        contexts = [n + 1 for n in contexts]
        crossing = [i for i, n in enumerate(contexts) if n > len(tables[i]) * BLOCK]
        for i in crossing:
            tables[i] = tables[i] + [tables[i][-1] + 1]  # the spare block after each table
        packed = pack_step(_decode_step(contexts, tables), BLOCK)
        _, _, meta = incremental.build_inputs(packed)
        baseline.build_inputs(packed)
        assert incremental.decode_tables.rows_written == len(crossing) <= BATCH // BLOCK
        assert incremental.decode_tables.values_written == len(crossing)
        # ids, positions, slots and lengths, 16-byte padded, plus a pair per new block.
        assert incremental.staging.staged_elements <= 4 * BATCH + 2 * len(crossing) + 16
        assert baseline.staging.staged_elements >= BATCH * blocks
        assert incremental.staging.staged_elements * 50 < baseline.staging.staged_elements
        for i in range(0, BATCH, 9):
            width = len(tables[i])
            assert meta.decode_block_tables[i, :width].tolist() == tables[i]


def test_persistent_tables_follow_random_steps():
    rng = random.Random(0)
    rows = BlockTableRows(CPU)
    live: list[list[int]] = []
    next_block = 0
    for _ in range(300):
        action = rng.random()
        if action < 0.15 and live:
            live.pop(rng.randrange(len(live)))  # a sequence finishes
        elif action < 0.3 or not live:
            n = rng.randint(1, 40)  # one joins, sometimes wider than any before (the table grows)
            live.insert(rng.randrange(len(live) + 1), list(range(next_block, next_block + n)))
            next_block += n
        elif action < 0.4:
            rng.shuffle(live)
        elif action < 0.5 and len(live) > 1:
            i = rng.randrange(len(live))  # a shorter table under a row that held a longer one
            live[i] = live[i][:rng.randint(1, len(live[i]))]
        for t in live:
            if rng.random() < 0.2:
                t.append(next_block)
                next_block += 1
        positions, values = rows.delta(live)
        assert len(values) <= sum(map(len, live))
        rows.apply(torch.tensor(positions, dtype=torch.long), torch.tensor(values, dtype=torch.long))
        table = rows.rows(len(live))
        for r, t in enumerate(live):
            assert table[r, :len(t)].tolist() == t
    assert rows.table.shape[1] >= 40 and rows.table.shape[1] & (rows.table.shape[1] - 1) == 0


def test_a_fixed_table_refuses_to_grow():
    fixed = torch.zeros(2, 4, dtype=torch.long)
    rows = BlockTableRows(CPU, fixed)
    positions, values = rows.delta([[1, 2, 3], [4]])
    rows.apply(torch.tensor(positions), torch.tensor(values))
    assert fixed.tolist() == [[1, 2, 3, 0], [4, 0, 0, 0]]
    try:
        rows.delta([[1] * 5])
    except ValueError as e:
        assert "exceed" in str(e)
    else:
        raise AssertionError("a fixed table cannot widen")
