"""The CUDA graph logic of decode steps, on CPU: which batch sizes are captured, which one a step
pads up to, what the persistent input buffers hold after a refill, and that replaying from them
(a stand-in that reruns the captured forward pass) computes what an eager step computes, with
the padding rows touching nothing but the spare block. The Triton kernels run in the interpreter."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: CPU tensors, no GPU

import torch
from tiny_model import tiny_runner

from meshserve.distributed.expert_load import ExpertLoadRecorder
from meshserve.distributed.parallel_state import ParallelState, set_parallel_state
from meshserve.layers import fused
from meshserve.layers.attention import AttentionSpec, create_backend
from meshserve.layers.attention.triton_backend import TritonAttentionMetadata
from meshserve.layers.cpu_gemm import PrepackedMatmul
from meshserve.layers.moe import RouterSpec, SparseMoeBlock
from meshserve.worker.cuda_graphs import (
    DecodeGraphInputs,
    DecodeGraphs,
    capture_sizes,
    graphs_disabled_reason,
    padded_batch_size,
)
from meshserve.worker.step import SeqStep, StepInput
from meshserve.worker.step_packing import pack_step

BLOCK = 8
CPU = torch.device("cpu")


def test_capture_sizes_follow_the_decode_batch_limit():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(5) == [1, 2, 4, 8]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    assert capture_sizes(100)[-1] == 104  # the first size that holds the limit
    assert capture_sizes(10_000)[-1] == 512  # beyond the largest size, steps run eagerly


def test_a_step_pads_up_to_the_smallest_size_that_holds_it():
    sizes = capture_sizes(64)
    assert [padded_batch_size(sizes, n) for n in (1, 2, 3, 4, 5, 8, 9, 64)] == [1, 2, 4, 4, 8, 8, 16, 64]
    assert padded_batch_size(sizes, 65) is None


def test_when_graphs_are_used():
    spec = AttentionSpec(4, 2, BLOCK)
    triton, reference = create_backend("triton", spec, CPU), create_backend("torch", spec, CPU)
    assert graphs_disabled_reason("cuda", False, triton) is None
    assert "enforce_eager" in graphs_disabled_reason("cuda", True, triton)
    assert "torch attention backend" in graphs_disabled_reason("cuda", False, reference)
    assert graphs_disabled_reason("cpu", False, triton) is not None


def test_moe_blocks_that_read_the_host_run_eagerly():
    """Tensor parallelism captures (no condition on it); an MoE block on the expert loop vetoes."""
    triton = create_backend("triton", AttentionSpec(4, 2, BLOCK), CPU)
    set_parallel_state(ParallelState())
    block = SparseMoeBlock(16, 32, RouterSpec(4, 2, renormalize=True))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), block)
    assert graphs_disabled_reason("cuda", False, triton, model) is None
    block.experts.quant = []  # what GroupedExperts.quantize sets for quantized experts
    assert "quantized experts" in graphs_disabled_reason("cuda", False, triton, model)
    block.experts.quant, block.ep_size = None, 2
    assert "expert parallelism" in graphs_disabled_reason("cuda", False, triton, model)


def test_a_replays_padding_rows_are_not_counted_as_expert_load():
    """In a captured decode step the padding rows are routed like real ones; the recorder counts
    only the rows the replay marks as real."""
    set_parallel_state(ParallelState())
    torch.manual_seed(0)
    block = SparseMoeBlock(16, 32, RouterSpec(4, 2, renormalize=True))
    for p in block.parameters():  # made empty, for a checkpoint to fill
        torch.nn.init.normal_(p, std=0.2)
    block.layer, block.recorder = 0, ExpertLoadRecorder([0], 4)
    x = torch.randn(6, 16)
    with fused.force_triton(), torch.inference_mode():
        block(x[:2])
        alone = block.recorder.take()[0]
        block.recorder.row_mask = torch.tensor([1, 1, 0, 0, 0, 0])
        padded = block(torch.cat([x[:2], x[2:]]))
        masked = block.recorder.take()[0]
        block.recorder.row_mask = None
        torch.testing.assert_close(padded[:2], block(x[:2]), rtol=1e-5, atol=1e-5)
    assert masked == alone and sum(alone) == 2 * 2


def test_capture_hands_the_real_rows_to_the_expert_load_recorder():
    class Probe(torch.nn.Module):  # a model whose forward reads what the recorder sees
        def __init__(self):
            super().__init__()
            self.expert_load = ExpertLoadRecorder([0], 4)

        def forward(self, ids, positions, caches, meta, hidden=None):
            return self.expert_load.row_mask.float()[:, None] * torch.ones(1, 3)

    backend = create_backend("triton", AttentionSpec(4, 2, BLOCK), CPU)
    inputs = DecodeGraphInputs(4, 4, 9, BLOCK, torch.device("cpu"))
    model = Probe()
    graphs = DecodeGraphs(model, [], inputs, [4], backend, new_capture=RerunCapture)
    graphs.capture()
    assert model.expert_load.row_mask is None  # set for the capture only
    model.expert_load.row_mask = inputs.real_rows(4)  # what the captured kernels keep reading
    packed = pack_step(_decodes([5, 9, 3]), BLOCK)
    graphs.run(packed)
    assert inputs.real_rows(4).tolist() == [1, 1, 1, 0]


def _decodes(contexts: list[int], first_block: int = 0) -> StepInput:
    """One decode per context length; sequence i owns consecutive blocks from first_block on."""
    seqs, block = [], first_block
    for i, n in enumerate(contexts):
        blocks = -(-n // BLOCK)
        seqs.append(SeqStep(i, [10 + i], n - 1, list(range(block, block + blocks)), sample=True))
        block += blocks
    return StepInput(seqs)


def test_refill_writes_the_step_then_padding_rows():
    pad_block = 50
    inputs = DecodeGraphInputs(max_batch=8, max_blocks_per_seq=6, pad_block=pad_block, block_size=BLOCK,
                               device=torch.device("cpu"))
    wide = pack_step(_decodes([40, 9]), BLOCK)  # 5 and 2 blocks
    inputs.fill(wide, 4)
    narrow = pack_step(_decodes([3]), BLOCK)
    inputs.fill(narrow, 2)
    ids, positions, slots, lens, real = inputs.scalars[:, :2].tolist()
    assert ids == [10, 0] and positions == [2, 0] and lens == [3, 1] and real == [1, 0]
    assert slots == [2, pad_block * BLOCK]  # padding writes into the spare block only
    assert inputs.block_tables[:2, 0].tolist() == [0, pad_block]
    # Columns past this step's width keep the wide step's blocks: unread, since lens bound every read.
    assert inputs.block_tables[0, 1:5].tolist() == [1, 2, 3, 4]
    backend = create_backend("triton", AttentionSpec(4, 2, BLOCK), CPU)
    _, _, meta, hidden = inputs.views(2, backend)
    assert isinstance(meta, TritonAttentionMetadata) and meta.backend is backend
    assert meta.num_prefill_tokens == 0 and hidden is None
    assert meta.decode_block_tables.shape == (2, 6) and meta.decode_context_lens.tolist() == [3, 1]


class RerunCapture:
    """Stands in for a CUDA graph: replay reruns the captured function into the captured output,
    reading the same persistent buffers a graph would."""

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self):
        with torch.inference_mode():  # as ModelRunner.forward runs it
            self.out.copy_(self.fn())


def test_graph_replay_equals_an_eager_step(tmp_path, monkeypatch):
    # On this CPU stand-in a padded batch could cross the row count where the packed CPU matmuls
    # take over from the GEMV (none run on a GPU); one matmul path for every row count keeps padding exact.
    monkeypatch.setattr(PrepackedMatmul, "packed_min_rows", 1)
    monkeypatch.setenv("MESHSERVE_DISABLE_GEMV", "1")
    runner = tiny_runner(tmp_path, block_size=BLOCK)
    # What CUDA selects; the interpreter runs it here.
    backend = runner.attn_backend = create_backend("triton", runner.attn_backend.spec, runner.device)
    num_blocks, pad_block = 30, 30
    caches = [torch.zeros(2, num_blocks + 1, BLOCK, runner.num_kv_heads, runner.head_dim) for _ in range(2)]
    runner.kv_caches = caches
    # Prefill three sequences eagerly so that the decodes below read real K/V.
    contexts = [5, 17, 9]
    prefill = _decodes(contexts)
    for s, n in zip(prefill.seqs, contexts):
        s.token_ids, s.start = list(range(1, n)), 0
    runner.forward(prefill)

    inputs = DecodeGraphInputs(4, -(-runner.max_model_len // BLOCK), pad_block, BLOCK, torch.device("cpu"))
    graphs = DecodeGraphs(runner.model, caches, inputs, [1, 2, 4], backend, new_capture=RerunCapture)
    graphs.capture()

    for step in (_decodes(contexts), _decodes(contexts[:2])):  # padded to 4, then exactly 2
        packed = pack_step(step, BLOCK)
        assert graphs.can_run(packed)
        eager_caches = [c.clone() for c in caches]
        with torch.inference_mode():
            ids, positions, meta = backend.build_inputs(packed)
            expected = runner.model(ids, positions, eager_caches, meta)
            got = graphs.run(packed)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        for live, eager in zip(caches, eager_caches):
            torch.testing.assert_close(live[:, :num_blocks], eager[:, :num_blocks], rtol=0, atol=0)
    assert not graphs.can_run(pack_step(_decodes([3] * 5), BLOCK))  # above the largest size: eager
    assert not graphs.can_run(pack_step(prefill, BLOCK))  # prefills always run eagerly
