"""Decode steps replayed from CUDA graphs.

A decode step of a small model is mostly kernel-launch overhead: hundreds of small kernels, each
launched from Python. Captured once per batch size into a CUDA graph, the whole forward pass is
one launch. As in vLLM (`cudagraph_capture_sizes`), graphs exist for a set of batch sizes (1, 2,
4, then multiples of 8) and a step runs in the smallest one that holds it; the rows past its
batch are padding.

A graph replays fixed device addresses, so it reads its inputs from persistent buffers
(`DecodeGraphInputs`) that each replay refills with one host-to-device copy (of the block
tables, only the entries that changed since the last replay).
Padding rows must not touch live cache blocks: they write their K/V into a spare block allocated
past the ones the scheduler hands out, and attend to that block alone.

Prefill and mixed steps, batches above the largest size, models whose forward reads the device
on the host (MoE layers under expert parallelism or with quantized experts: graph_unsafe_reason)
and attention backends whose metadata a capture cannot hold (all but Triton's) run eagerly, as
does everything with `enforce_eager`. Only the sizes, the padding and the buffers are logic of our own; they are
tested on CPU with a stand-in for the capture.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Protocol

import torch

from meshserve.layers.attention import AttentionBackend
from meshserve.layers.host_to_device import BlockTableRows, HostStaging
from meshserve.worker.step_packing import PackedStep

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_decode_batch: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """1, 2, 4, then multiples of 8, up to the first that holds `max_decode_batch` (at most `limit`)."""
    sizes = []
    for size in [1, 2, 4, *range(8, limit + 1, 8)]:
        sizes.append(size)
        if size >= max_decode_batch:
            break
    return sizes


def padded_batch_size(sizes: list[int], batch: int) -> int | None:
    """The smallest captured size that holds `batch` sequences; None when none does (run eagerly)."""
    return next((s for s in sizes if s >= batch), None)


def graphs_disabled_reason(device_type: str, enforce_eager: bool, backend: AttentionBackend,
                           model: torch.nn.Module | None = None) -> str | None:
    """Why decode steps run eagerly, or None when they replay CUDA graphs. A module of `model` with
    a `graph_unsafe_reason()` (an MoE block that reads token counts on the host) can veto them.
    Tensor parallelism does not: NCCL's collectives are captured, and the communication timer
    records no events while a capture runs."""
    if device_type != "cuda":
        return "not a CUDA device"
    if enforce_eager:
        return "enforce_eager is set"
    if not backend.supports_cuda_graphs:
        return f"the {backend.name} attention backend does not support CUDA graphs"
    for module in model.modules() if model is not None else ():
        reason = getattr(module, "graph_unsafe_reason", None)
        if callable(reason) and (why := reason()) is not None:
            return why
    return None


class DecodeGraphInputs:
    """The persistent device tensors captured graphs read, and the refill before each replay."""

    def __init__(self, max_batch: int, max_blocks_per_seq: int, pad_block: int, block_size: int,
                 device: torch.device, hidden_size: int | None = None, hidden_dtype: torch.dtype | None = None):
        self.device = device
        self.pad_block = pad_block
        self.pad_slot = pad_block * block_size
        # Rows: token ids, positions, cache slots, context lengths, 1 for a real row (0: padding);
        # an even row length keeps every row 16-byte aligned, as the kernels were compiled for.
        self.scalars = torch.zeros(5, max_batch + max_batch % 2, dtype=torch.long, device=device)
        self.block_tables = torch.full((max_batch, max_blocks_per_seq), pad_block, dtype=torch.long, device=device)
        self._staging = HostStaging(device)
        self._table_rows = BlockTableRows(device, self.block_tables)  # a replay sends only changed entries
        self.hidden = (torch.zeros(max_batch, hidden_size, dtype=hidden_dtype, device=device)
                       if hidden_size is not None else None)  # a later pipeline stage's input
        self._fill_padding(0, max_batch)

    def _fill_padding(self, start: int, end: int) -> None:
        """Padding rows: token 0 at position 0, written into the spare block, which is all they see."""
        self.scalars[:2, start:end] = 0
        self.scalars[2, start:end] = self.pad_slot
        self.scalars[3, start:end] = 1
        self.scalars[4, start:end] = 0
        self.block_tables[start:end, 0] = self.pad_block

    def fill(self, packed: PackedStep, padded: int, hidden: torch.Tensor | None = None) -> None:
        """Copy a decode-only step into the first rows and pad up to `padded` rows."""
        n = len(packed.decode_context_lens)
        pad = padded - n
        scalars = (packed.input_ids + [0] * pad + packed.positions + [0] * pad
                   + packed.slot_mapping + [self.pad_slot] * pad + packed.decode_context_lens + [1] * pad
                   + [1] * n + [0] * pad)
        # Entries past a row's table may hold an earlier step's blocks: the context lengths keep them unread.
        tables = packed.decode_block_tables + [[self.pad_block]] * pad
        staged, positions, values = self._staging.to_device([scalars, *self._table_rows.delta(tables)])
        self.scalars[:, :padded].copy_(staged.view(5, padded))
        self._table_rows.apply(positions, values)
        if hidden is not None:  # a later pipeline stage, whose inputs were made with hidden_size
            assert self.hidden is not None
            self.hidden[:n].copy_(hidden)

    def real_rows(self, batch: int) -> torch.Tensor:
        """1 for each of the first `batch` rows that holds a sequence, 0 for padding."""
        return self.scalars[4, :batch]

    def views(self, batch: int, backend: AttentionBackend):
        """(ids, positions, metadata, hidden) over the first `batch` rows, as a graph captures them."""
        ids, positions, slots, lens, _ = self.scalars[:, :batch]
        meta = backend.decode_graph_metadata(slots, self.block_tables[:batch], lens)
        return ids, positions, meta, None if self.hidden is None else self.hidden[:batch]


class GraphCapture(Protocol):
    """Capture `fn` once and replay it: torch.cuda.CUDAGraph on a GPU, a stand-in in the tests."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...
    def replay(self) -> None: ...


class CudaGraphCapture:
    def __init__(self, pool):
        self.pool = pool  # shared by every size: a replay's activations reuse the same memory
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        fn()  # warm-up outside the capture: compiles the Triton kernels, creates cuBLAS handles
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class DecodeGraphs:
    """One captured forward pass per batch size; `run` replays the one that fits a decode step."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], inputs: DecodeGraphInputs,
                 sizes: list[int], backend: AttentionBackend, new_capture: Callable[[], GraphCapture] | None = None,
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.model, self.kv_caches, self.inputs, self.sizes, self.backend = model, kv_caches, inputs, sizes, backend
        # The LM head and the greedy argmax, captured after the forward (the last stage's): two
        # launches fewer per step. A replay leaves its rows' (logits, argmax) in `last_head`.
        self.head = head
        self._head_out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.last_head: tuple[torch.Tensor, torch.Tensor] | None = None
        if new_capture is None:
            pool = torch.cuda.graph_pool_handle()
            new_capture = lambda: CudaGraphCapture(pool)  # noqa: E731
        self._new_capture = new_capture
        self._graphs: dict[int, tuple[GraphCapture, torch.Tensor]] = {}
        # Steps served by a replay: a check can tell graphs that were captured but never used (a
        # silent eager fallback) from graphs that ran.
        self.replays = 0

    @torch.inference_mode()
    def capture(self) -> None:
        for size in sorted(self.sizes, reverse=True):  # largest first: smaller ones fit in its memory
            ids, positions, meta, hidden = self.inputs.views(size, self.backend)
            graph = self._new_capture()
            forward = partial(self.model, ids, positions, self.kv_caches, meta, hidden=hidden)
            recorder = getattr(self.model, "expert_load", None)  # an MoE model's routing counts
            if recorder is not None:
                recorder.row_mask = self.inputs.real_rows(size)
            try:
                out = graph.capture(partial(self._forward, size, forward))
            finally:
                if recorder is not None:
                    recorder.row_mask = None
            self._graphs[size] = (graph, out)

    def _forward(self, size: int, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        hidden = forward()
        if self.head is not None:  # the tensors of the captured call are the ones a replay refills
            logits = self.head(hidden)
            self._head_out[size] = (logits, logits.argmax(-1))
        return hidden

    def can_run(self, packed: PackedStep) -> bool:
        return packed.is_decode_only and padded_batch_size(self.sizes, len(packed.decode_context_lens)) is not None

    def run(self, packed: PackedStep, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The step's hidden states, copied out of the graph's memory: the next replay (a pipeline
        stage's next micro-batch) overwrites it while this one may still be sending."""
        n = len(packed.decode_context_lens)
        size = padded_batch_size(self.sizes, n)
        assert size is not None, "run only a step that can_run accepts"
        self.inputs.fill(packed, size, hidden)
        graph, out = self._graphs[size]
        graph.replay()
        self.replays += 1
        if self.head is not None:
            logits, tokens = self._head_out[size]
            self.last_head = (logits[:n], tokens[:n])
        return out[:n].clone()
