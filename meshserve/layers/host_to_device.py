"""Host lists to device tensors without stalling the GPU queue, and without new Triton compiles.

`torch.tensor(values, device="cuda")` copies from pageable memory, and CUDA performs such a copy
only after the stream has drained: a host sync per call. On CUDA these helpers stage the values
in pinned memory and copy them with non_blocking=True; several arrays travel in one copy. On CPU
they are plain host tensors.

Several arrays in one flat buffer would start at whatever offset the previous ones' lengths
leave, and Triton specializes a kernel on whether each pointer argument is 16-byte aligned: a
step whose token count is odd would compile the attention kernels again (seconds, mid-serving).
Every array therefore starts on a 16-byte boundary (`aligned_offsets`).

`HostStaging` keeps its host buffers from step to step (pinned where CUDA is available), and
`BlockTableRows` keeps a step's block tables on the device, rewriting only the entries that
changed: at batch 64 and 4k context a decode step otherwise rebuilds and copies 16k block ids,
of which a few change per step.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

ALIGN_BYTES = 16  # what Triton's pointer specialization checks


def aligned_offsets(lengths: Sequence[int], itemsize: int) -> tuple[list[int], int]:
    """Where each array starts in a flat buffer so that every start is 16-byte aligned (given an
    aligned buffer), and the buffer's length in elements."""
    quantum = max(1, ALIGN_BYTES // itemsize)
    offsets, end = [], 0
    for n in lengths:
        offsets.append(end)
        end += -(-n // quantum) * quantum
    return offsets, end


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One (possibly nested) list as a tensor on `device`."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def arrays_to_device(arrays: Sequence[Sequence], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Flat lists as 1-D tensors on `device`; on CUDA all of them through a single copy."""
    if device.type != "cuda":
        return [torch.tensor(a, dtype=dtype) for a in arrays]
    offsets, total = aligned_offsets([len(a) for a in arrays], dtype.itemsize)
    flat = [0] * total
    for a, at in zip(arrays, offsets):
        flat[at:at + len(a)] = a
    dev = torch.tensor(flat, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return [dev.narrow(0, at, len(a)) for a, at in zip(arrays, offsets)]


class HostStaging:
    """Persistent host buffers through which a step's integer arrays reach the device in one copy.

    Two buffers alternate: a step fills one while the copy out of the other may still be queued.
    On CUDA an event recorded after each copy guards the buffer's reuse (the engine reads every
    step's sampled tokens, so the wait returns at once). Off CUDA the buffer is plain host memory
    and each step gets its own tensor (a clone), as the kernels may still hold the previous one."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.long):
        self.device, self.dtype = torch.device(device), dtype
        self._pin = self.device.type == "cuda" and torch.cuda.is_available()
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.staged_elements = 0  # of the last call, padding included: the host-to-device traffic

    def _buffer(self, size: int) -> tuple[int, torch.Tensor]:
        turn = self._turn
        self._turn ^= 1
        done = self._copied[turn]
        if done is not None:
            done.synchronize()
        buf = self._buffers[turn]
        if buf is None or buf.numel() < size:
            grown = max(size, 2 * buf.numel() if buf is not None else 1024)
            with torch.inference_mode(False):  # a buffer outlives the step that made it
                buf = self._buffers[turn] = torch.zeros(grown, dtype=self.dtype, pin_memory=self._pin)
        return turn, buf

    def to_device(self, arrays: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Flat lists as 1-D tensors on the device, each starting 16-byte aligned."""
        lengths = [len(a) for a in arrays]
        offsets, total = aligned_offsets(lengths, self.dtype.itemsize)
        turn, buf = self._buffer(total)
        host = buf.numpy()
        for a, at, n in zip(arrays, offsets, lengths):
            if n:
                host[at:at + n] = a
        self.staged_elements = total
        if self.device.type == "cuda":
            dev = buf[:total].to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._copied[turn] = event
        else:
            dev = buf[:total].clone()
        return [dev.narrow(0, at, n) for at, n in zip(offsets, lengths)]


def _next_power_of_2(n: int, least: int) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


class BlockTableRows:
    """Block tables held on the device across steps: row r is the r-th decode of a step. A step
    sends only (flat position, block id) pairs for entries its tables change; a sequence that
    keeps its row and its blocks costs nothing, one that crosses into a new block costs one entry.

    `_held[r]` mirrors what row r holds on the device, as far as any step has written it.
    Entries past a row's current table may be stale: kernels read only up to the context length.
    `table`, when given (a CUDA graph's persistent buffer), is used as is; otherwise the table
    grows (rows and width to powers of two), keeping its contents, as steps need."""

    def __init__(self, device: torch.device, table: torch.Tensor | None = None):
        self.device = torch.device(device)
        self.table = table if table is not None else torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self._fixed = table is not None
        self._held: list[list[int]] = []
        self.rows_written = 0  # by the last delta
        self.values_written = 0

    def _reserve(self, rows: int, width: int) -> None:
        have_rows, have_width = self.table.shape
        if rows <= have_rows and width <= have_width:
            return
        if self._fixed:
            raise ValueError(f"{rows} block tables of up to {width} blocks exceed the table {tuple(self.table.shape)}")
        with torch.inference_mode(False):  # written in place by later steps, in or out of inference mode
            grown = torch.zeros(_next_power_of_2(rows, max(8, have_rows)), _next_power_of_2(width, max(16, have_width)),
                                dtype=torch.long, device=self.device)
            grown[:have_rows, :have_width] = self.table
        self.table = grown

    def delta(self, tables: Sequence[list[int]]) -> tuple[list[int], list[int]]:
        """(flat positions, block ids) that make rows 0..len(tables)-1 start with `tables`; the
        mirror is updated as if `apply` had written them."""
        self._reserve(len(tables), max((len(t) for t in tables), default=0))
        width = self.table.shape[1]
        held = self._held
        held.extend([] for _ in range(len(tables) - len(held)))
        positions: list[int] = []
        values: list[int] = []
        rows = 0
        for r, t in enumerate(tables):
            h, n = held[r], len(t)
            if n == len(h):
                if h == t:
                    continue
                first = 0
            elif n < len(h):
                if h[:n] == t:
                    continue
                first = 0
            else:
                first = len(h) if t[:len(h)] == h else 0  # grown by whole blocks: send only those
            rows += 1
            base = r * width
            positions.extend(range(base + first, base + n))
            values.extend(t[first:] if first else t)
            held[r] = list(t) if n >= len(h) else t + h[n:]
        self.rows_written, self.values_written = rows, len(values)
        return positions, values

    def apply(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Write a delta's pairs, as device tensors, into the table (queued on the stream after
        every kernel that read the previous contents)."""
        if positions.numel():
            self.table.view(-1).index_copy_(0, positions, values)

    def rows(self, batch: int) -> torch.Tensor:
        return self.table[:batch]
