"""One rank of a replica: its share of the CPU, its place in the process groups, its model shard, and
the step loop over pipeline micro-batches. The executors (in-process, multiprocessing, Ray) only move
steps and replies; what a rank does is defined here once."""
from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from meshserve.config import EngineConfig
from meshserve.distributed.parallel_state import (
    ParallelState,
    init_distributed,
    set_parallel_state,
)
from meshserve.distributed.placement import pin_to_cores
from meshserve.distributed.timing import RankTiming
from meshserve.layers.host_to_device import to_device
from meshserve.models.loader import ModelSource
from meshserve.worker.kv_blocks import KVPart, WireTensor, export_blocks, import_blocks, kv_layout, unwrap
from meshserve.worker.microbatch import (
    MIN_MICROBATCH_TOKENS,
    num_tokens,
    split_microbatches,
)
from meshserve.worker.model_runner import ModelRunner
from meshserve.worker.step import RankStepOutput, StepInput

logger = logging.getLogger("meshserve")

# A collective that waits this long means a peer is gone or stuck; the rank then fails loudly.
COLLECTIVE_TIMEOUT_S = 600.0


class Worker:
    """`store` is a connected torch.distributed store (None for a single rank, which then needs no
    process group at all)."""

    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int, rank: int = 0,
                 store=None, device: torch.device | None = None, cores: list[int] | None = None):
        if cores:
            pin_to_cores(cores)
        device = device or config.resolved_device()
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # NCCL and the caching allocator use the current device
        if store is None:
            self.ps = ParallelState(device=device)
            set_parallel_state(self.ps)
        else:
            self.ps = init_distributed(rank, config.tensor_parallel_size, config.pipeline_parallel_size, store,
                                       device, COLLECTIVE_TIMEOUT_S, config.enable_expert_parallel)
        self.rank = rank
        self.config = config
        self.runner = ModelRunner(config, source, max_model_len)
        tp = self.ps.tp_size
        self.prev_rank = self.ps.rank - tp  # same TP rank, previous stage
        self.next_rank = self.ps.rank + tp
        # Sends still running, with their tensors.
        self._inflight: list[tuple[torch.distributed.Work, torch.Tensor]] = []
        self._profiler: torch.profiler.profile | None = None
        self.min_microbatch_tokens = MIN_MICROBATCH_TOKENS.get(device.type, 1)
        # The tokens the last step sampled here, by sequence: a step scheduled before the engine saw
        # them (overlap scheduling) reads its pending input tokens from them.
        self._last_sampled: dict[int, int] = {}

    @property
    def info(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "block_bytes": self.runner.block_bytes,
                "num_kv_heads": self.runner.num_kv_heads, "layers": list(self.runner.model.layer_range),
                "experts": self.runner.expert_info, "kv_layout": kv_layout(self.runner)}

    def num_kv_blocks(self) -> int:
        return self.runner.num_kv_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks)
        if self.config.profile_dir:  # profile serving steps only, not loading
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.ps.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=acts)
            self._profiler.start()

    def export_kv(self, block_ids: list[int]) -> KVPart:
        """This rank's layers and KV heads of the cache blocks `block_ids` (worker/kv_blocks.py)."""
        return export_blocks(self.runner, block_ids)

    def import_kv(self, block_ids: list[int], full: torch.Tensor | WireTensor) -> None:
        """Write this rank's share of `full`, the canonical tensor of the blocks `block_ids`, into them."""
        import_blocks(self.runner, block_ids, unwrap(full))

    @torch.inference_mode()
    def execute(self, step: StepInput) -> RankStepOutput:
        """Run one step through this rank's stage: the sampled tokens (sampling rank), the timing,
        and the tokens routed to each expert of this stage's MoE layers (from one rank per stage)."""
        t0 = time.perf_counter()
        ps, runner = self.ps, self.runner
        step = self._fill_pending(step)
        # marked only under a profiler (the mark costs microseconds a step without one)
        marked = torch.autograd._profiler_enabled()
        with torch.profiler.record_function("meshserve_step") if marked else contextlib.nullcontext():
            # The last stage has replied for the previous step, so its sends are done: this returns at once.
            ps.wait([w for w, _ in self._inflight])
            self._inflight = []
            pieces = split_microbatches(step, ps.pp_size, self.min_microbatch_tokens)
            rows = []
            for piece in pieces:
                hidden = None
                if not ps.is_first_stage:
                    shape = (num_tokens(piece), runner.model.cfg.hidden_size)
                    hidden = ps.recv(shape, runner.dtype, self.prev_rank)
                out, sample_rows = runner.forward(piece, hidden)
                if not ps.is_last_stage:
                    self._inflight.append((ps.isend(out, self.next_rank), out))
                elif sample_rows == list(range(out.shape[0])):  # a decode step: every row, no gather
                    rows.append(out)
                elif sample_rows:
                    rows.append(out[to_device(sample_rows, torch.long, out.device)])
            sampled, sample_s = None, 0.0
            if ps.is_last_stage:
                t_sample = time.perf_counter()
                sampled = runner.sample(step, rows[0] if len(rows) == 1 else torch.cat(rows) if rows else None)
                sample_s = time.perf_counter() - t_sample
                if sampled is not None:
                    self._last_sampled = dict(zip((s.seq_id for s in step.seqs if s.sample), sampled.token_ids))
            if ps.device.type == "cuda":  # the step's one sync (free on the sampling rank, which has read its tokens)
                torch.cuda.synchronize(ps.device)
        comm = ps.comm_timer.take()
        timing = RankTiming(self.rank, time.perf_counter() - t0 - sum(comm.values()), comm, sample_s)
        return RankStepOutput(sampled, timing, runner.take_expert_counts())

    def _fill_pending(self, step: StepInput) -> StepInput:
        """The step with each pending input token replaced by the token its sequence sampled in the
        step before. Only a rank that both samples and embeds tokens has them (a single rank); a step
        after one that failed finds none and fails before it computes anything."""
        last, self._last_sampled = self._last_sampled, {}
        if not any(s.from_last_sample for s in step.seqs):
            return step
        if self.ps.world_size > 1:
            raise RuntimeError("a step with pending tokens reached a rank of a multi-rank replica")
        seqs = []
        for s in step.seqs:
            if s.from_last_sample:
                if s.seq_id not in last:
                    raise RuntimeError(f"sequence {s.seq_id}'s input is the token it sampled last step, "
                                       "but the last step sampled none for it")
                s = replace(s, token_ids=[last[s.seq_id]], from_last_sample=False)
            seqs.append(s)
        return replace(step, seqs=seqs)

    def close(self) -> None:
        if self._profiler is not None:
            assert self.config.profile_dir, "init_kv_cache starts the profiler only with a profile_dir"
            self._profiler.stop()
            out = Path(self.config.profile_dir) / f"trace_rank{self.rank}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            self._profiler.export_chrome_trace(str(out))
            self._profiler = None
            logger.info("rank %d: torch.profiler trace written to %s", self.rank, out)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
