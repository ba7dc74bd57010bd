"""Process groups of one replica and timed collectives.

A replica has TP x PP ranks; rank = pp_rank * tp_size + tp_rank. With a world of one process nothing
here touches torch.distributed, so the single-device path has no communication at all.
Every collective adds its time to `comm_timer`, which the runner reports as the step's
communication share (the time in cross-device reduction). On CPU that is the call's wall time. On
CUDA the calls return before the transfer has run, and synchronizing around each one (four host
syncs per layer under TP) would stall the queue: a pair of CUDA events on the compute stream
brackets each collective instead, and the events are read at the end of the step, after the
step's one sync.
"""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class CommTimer:
    """Communication seconds by kind since the last `take()`."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self.seconds: dict[str, float] = {}
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # CUDA: read at take()
        self._spare_events: list[torch.cuda.Event] = []

    def add(self, kind: str, dt: float) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + dt

    def timed(self, kind: str) -> _Timed:
        """`with timer.timed(kind): collective()` adds the collective's time to `kind`."""
        return _Timed(self, kind)

    def _event(self) -> torch.cuda.Event:
        return self._spare_events.pop() if self._spare_events else torch.cuda.Event(enable_timing=True)

    def take(self) -> dict[str, float]:
        """The totals, and a fresh start. On CUDA call it once the step's work has finished."""
        for kind, start, end in self._pending:
            end.synchronize()  # already complete after the step's sync: returns at once
            self.add(kind, start.elapsed_time(end) / 1e3)
            self._spare_events += [start, end]
        self._pending = []
        out, self.seconds = self.seconds, {}
        return out


class _Timed:
    __slots__ = ("kind", "start", "t0", "timer")

    def __init__(self, timer: CommTimer, kind: str) -> None:
        self.timer, self.kind = timer, kind
        self.start: torch.cuda.Event | None = None

    def __enter__(self) -> None:
        timer = self.timer
        if timer.device.type != "cuda":
            self.t0 = time.perf_counter()
        elif not torch.cuda.is_current_stream_capturing():  # a graph cannot record timing events
            self.start = timer._event()
            self.start.record()

    def __exit__(self, *exc: object) -> None:
        timer = self.timer
        if timer.device.type != "cuda":
            timer.add(self.kind, time.perf_counter() - self.t0)
        elif self.start is not None:
            end = timer._event()
            end.record()
            timer._pending.append((self.kind, self.start, end))


@dataclass
class ParallelState:
    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    tp_group: dist.ProcessGroup | None = None  # this rank's TP peers (None: the default group)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    comm_timer: CommTimer = field(default_factory=CommTimer)
    # Expert parallelism: the MoE layers split whole experts over the TP ranks of a stage (EP = TP,
    # the same processes, never extra ones); 1 when it is off.
    ep_size: int = 1
    ep_rank: int = 0

    def __post_init__(self) -> None:
        self.comm_timer.device = self.device

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def all_reduce(self, x: torch.Tensor, kind: str = "all_reduce") -> torch.Tensor:
        if self.tp_size == 1:
            return x
        with self.comm_timer.timed(kind):
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each TP rank's slice of the last dimension (vocab-parallel logits)."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        with self.comm_timer.timed("all_gather"):
            dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def all_to_all(self, x: torch.Tensor, send_rows: list[int], recv_rows: list[int], kind: str) -> torch.Tensor:
        """Rows of `x` to the EP ranks (send_rows[r] consecutive rows to rank r); returns the rows
        received, in rank order. `kind` names the phase in the step timing (dispatch or combine)."""
        out = x.new_empty((sum(recv_rows), *x.shape[1:]))
        with self.comm_timer.timed(kind):
            _all_to_all_rows(out, x.contiguous(), recv_rows, send_rows, self.tp_group, self._ep_peers())
        return out

    def all_gather_stacked(self, x: torch.Tensor, kind: str = "all_gather") -> torch.Tensor:
        """[EP, *x.shape]: every EP rank's `x` (same shape on all ranks)."""
        parts = [torch.empty_like(x) for _ in range(self.ep_size)]
        with self.comm_timer.timed(kind):
            dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.stack(parts)

    def _ep_peers(self) -> list[int]:
        """Global ranks of this rank's EP group (its stage's TP ranks), in EP-rank order."""
        first = self.pp_rank * self.tp_size
        return list(range(first, first + self.ep_size))

    def send(self, x: torch.Tensor, dst: int) -> None:
        with self.comm_timer.timed("send_recv"):
            dist.send(x.contiguous(), dst)

    def isend(self, x: torch.Tensor, dst: int) -> dist.Work:
        """Start sending and return the work handle; the caller keeps `x` alive until it completes,
        so a pipeline stage computes its next micro-batch while this one is in flight."""
        with self.comm_timer.timed("send_recv"):
            work = dist.isend(x, dst)
        assert work is not None, "None only for a rank outside the default group, and every rank is in it"
        return work

    def wait(self, works: Sequence[dist.Work]) -> None:
        """Wait for sends to finish (on CUDA: make the compute stream wait for them)."""
        if not works:
            return
        with self.comm_timer.timed("send_recv"):
            for w in works:
                w.wait()

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=self.device)
        with self.comm_timer.timed("send_recv"):
            dist.recv(x, src)
        return x


# Some gloo builds have no all_to_all; the pairwise exchange below then takes over (found on first use).
_NATIVE_ALL_TO_ALL = True


def _all_to_all_rows(out: torch.Tensor, x: torch.Tensor, recv_rows: list[int], send_rows: list[int],
                     group: dist.ProcessGroup | None, peers: list[int]) -> None:
    global _NATIVE_ALL_TO_ALL
    if _NATIVE_ALL_TO_ALL:
        try:
            dist.all_to_all_single(out, x, recv_rows, send_rows, group=group)
            return
        except RuntimeError as e:  # e.g. "ProcessGroupGloo does not support alltoall"
            if "support" not in str(e):
                raise
            _NATIVE_ALL_TO_ALL = False
    _pairwise_all_to_all(out, x, recv_rows, send_rows, group, peers)


def _pairwise_all_to_all(out: torch.Tensor, x: torch.Tensor, recv_rows: list[int], send_rows: list[int],
                         group: dist.ProcessGroup | None, peers: list[int]) -> None:
    """The same exchange as point-to-point pairs: every rank posts all its sends and receives at once."""
    me = dist.get_rank()
    sends, recvs = x.split(send_rows), out.split(recv_rows)
    ops = []
    for r, peer in enumerate(peers):
        if peer == me:
            recvs[r].copy_(sends[r])
            continue
        if send_rows[r]:
            ops.append(dist.P2POp(dist.isend, sends[r].contiguous(), peer, group))
        if recv_rows[r]:
            ops.append(dist.P2POp(dist.irecv, recvs[r], peer, group))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def keep_gloo_on_loopback() -> None:
    """Ranks on one host talk over the loopback interface (unless GLOO_SOCKET_IFNAME says otherwise):
    gloo would otherwise pick the interface of the host name, which may be unreachable or public."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if loopback is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback


def init_distributed(rank: int, tp_size: int, pp_size: int, store: dist.Store, device: torch.device,
                     timeout_s: float, expert_parallel: bool = False) -> ParallelState:
    """Join this replica's process group (through an already connected store) and build the TP groups.
    Gloo on CPU, NCCL on CUDA. Every rank creates every TP group, in the same order, as
    torch.distributed requires. With `expert_parallel` the MoE layers use each TP group as their
    expert-parallel group."""
    from datetime import timedelta

    world = tp_size * pp_size
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    tp_group = None
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks, timeout=timeout) if tp_size > 1 else None
        if rank in ranks:
            tp_group = group
    state = ParallelState(tp_size, pp_size, rank % tp_size, rank // tp_size, tp_group, device)
    if expert_parallel:
        state.ep_size, state.ep_rank = tp_size, state.tp_rank
    set_parallel_state(state)
    return state


_STATE = ParallelState()


def get_parallel_state() -> ParallelState:
    return _STATE


def set_parallel_state(state: ParallelState) -> None:
    global _STATE
    _STATE = state
