"""The LM head and the greedy argmax run inside the decode graph on the last stage: a replay
leaves the logits and tokens of its rows, equal to the eager head's on the same hidden states,
and the runner's sampler takes them for a step that was one replay (a CPU stand-in replays the
captured function; the Triton kernels run in the interpreter). Replays refill the block tables
incrementally: a second replay with unchanged tables writes none of their entries."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: CPU tensors, no GPU

import torch
from tiny_model import tiny_runner

from meshserve.layers.attention import create_backend
from meshserve.layers.cpu_gemm import PrepackedMatmul
from meshserve.sampling_params import SamplingParams
from meshserve.worker.cuda_graphs import DecodeGraphInputs, DecodeGraphs
from meshserve.worker.step import SeqStep, StepInput
from meshserve.worker.step_packing import pack_step

BLOCK = 8
GREEDY = SamplingParams(temperature=0, max_tokens=4)


class RerunCapture:
    """A CUDA graph stand-in: replay reruns the captured function into the captured output."""

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self):
        with torch.inference_mode():
            self.out.copy_(self.fn())


def _step(contexts: list[int], decode: bool) -> StepInput:
    seqs, block = [], 0
    for i, n in enumerate(contexts):
        blocks = -(-n // BLOCK)
        tokens, start = ([20 + i], n - 1) if decode else (list(range(1, n)), 0)
        seqs.append(SeqStep(i, tokens, start, list(range(block, block + blocks)), sample=True, params=GREEDY))
        block += blocks
    return StepInput(seqs)


def test_the_graph_head_serves_the_sampler(tmp_path, monkeypatch):
    monkeypatch.setattr(PrepackedMatmul, "packed_min_rows", 1)  # one matmul path for every row count
    runner = tiny_runner(tmp_path, block_size=BLOCK)
    backend = runner.attn_backend = create_backend("triton", runner.attn_backend.spec, runner.device)
    num_blocks = 20
    runner.kv_caches = [torch.zeros(2, num_blocks + 1, BLOCK, runner.num_kv_heads, runner.head_dim)
                        for _ in runner.model.layers]
    contexts = [6, 11, 3]
    runner.forward(_step(contexts, decode=False))
    runner._step_heads.clear()  # the prefill's entry: no sample() call consumed it here

    inputs = DecodeGraphInputs(4, -(-runner.max_model_len // BLOCK), num_blocks, BLOCK, runner.device)
    runner.graphs = DecodeGraphs(runner.model, runner.kv_caches, inputs, [1, 2, 4], backend,
                                 new_capture=RerunCapture, head=runner._graph_head())
    runner.graphs.capture()
    step = _step(contexts, decode=True)
    eager_caches = [c.clone() for c in runner.kv_caches]
    with torch.inference_mode():
        ids, positions, meta = backend.build_inputs(pack_step(step, BLOCK))
        eager_logits = runner.model.compute_logits(runner.model(ids, positions, eager_caches, meta))
    hidden, rows = runner.forward(step)
    assert rows == [0, 1, 2] and len(runner._step_heads) == 1
    logits, tokens = runner.graphs.last_head
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert tokens.tolist() == eager_logits.argmax(-1).tolist()

    calls = []
    compute_logits = runner.model.compute_logits
    monkeypatch.setattr(runner.model, "compute_logits", lambda h: calls.append(h) or compute_logits(h))
    out = runner.sample(step, hidden[rows])
    assert out.token_ids == tokens.tolist() and calls == []  # the graph's head, not a second one
    assert runner._step_heads == []

    # Unchanged tables: the next replay writes none of their entries; a prefill runs eagerly.
    runner.forward(_step([n + 1 for n in contexts], decode=True))
    assert inputs._table_rows.values_written == 0
    runner.sample(step, hidden[rows])
    runner.forward(_step([5], decode=False))
    assert runner._step_heads == [None]
