"""ModelRunner: owns one rank's model shard and KV cache; turns a step's sequences into tensors,
runs the forward pass and (on the last pipeline stage's first TP rank) samples."""
from __future__ import annotations

import contextlib
import logging

import torch

from meshserve.config import CPU_DEFAULT_KV_BYTES, EngineConfig
from meshserve.distributed.parallel_state import get_parallel_state
from meshserve.engine.step import StepInput
from meshserve.layers import cpu_kernels
from meshserve.layers.attention import AttentionMetadata, PrefillSeq
from meshserve.layers.cpu_gemm import prepack_model
from meshserve.layers.moe import SparseMoeBlock
from meshserve.layers.rotary import RotaryEmbedding
from meshserve.layers.sampler import Sampler, SamplerOutput
from meshserve.models.loader import ModelSource
from meshserve.models.registry import model_class

logger = logging.getLogger(__name__)


def _init_dummy_(model: torch.nn.Module, seed: int) -> None:
    g = None
    for name, p in model.named_parameters():
        if g is None:
            g = torch.Generator(p.device).manual_seed(seed)
        if name.endswith("norm.weight") or "layernorm" in name:
            p.data.fill_(1.0)
        else:
            p.data.copy_(torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype) * 0.02)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int):
        self.config = config
        self.ps = get_parallel_state()
        self.device = self.ps.device
        self.dtype = config.resolved_dtype()
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        cfg = source.config
        torch.manual_seed(config.seed)
        if config.load_format == "dummy":
            # Built on the device in its dtype: a big geometry (an MoE's experts) must not first
            # materialise in float32 host memory.
            with torch.device(self.device), _default_dtype(self.dtype):
                model = model_class(cfg.architecture)(cfg, config.pipeline_split)
            _init_dummy_(model, config.seed + self.ps.rank)
        else:
            model = model_class(cfg.architecture)(cfg, config.pipeline_split)
            model.load_weights(source.iter_weights())
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        for m in self.model.modules():
            if isinstance(m, RotaryEmbedding):
                m.float()  # rotary tables stay float32: large positions lose precision in bf16
        if self.device.type == "cpu" and self.dtype == torch.float32:
            cpu_kernels.available()  # compile (or load) them now, not during the first request
        prepack_model(self.model)
        self.sampler = Sampler(config.seed, self.device) if self.ps.is_last_stage and self.ps.tp_rank == 0 else None
        attn = next(iter(self.model.layers.values())).self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.kv_caches: list[torch.Tensor] = []
        # MoE routing counts: every rank of a stage sees the same global counts, its first TP rank reports them.
        self.expert_load = getattr(self.model, "expert_load", None) if self.ps.tp_rank == 0 else None

    def take_expert_counts(self) -> dict[int, list[int]]:
        """Tokens routed to each expert of this stage's MoE layers since the last call ({} if none)."""
        return self.expert_load.take() if self.expert_load is not None else {}

    @property
    def expert_info(self) -> dict:
        """Where this rank's experts are: how many it holds and their bytes ({} for a dense model)."""
        blocks = [m.experts for m in self.model.modules() if isinstance(m, SparseMoeBlock)]
        if not blocks:
            return {}
        nbytes = sum(p.numel() * p.element_size() for b in blocks for p in b.parameters())
        first = blocks[0]
        return {"moe_layers": len(blocks), "local_experts": first.num_local, "first_expert": first.first_expert,
                "expert_bytes": nbytes}

    # ---- KV cache ----------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * len(self.model.layers) * self.num_kv_heads * self.head_dim * self.block_size * elem

    def num_kv_blocks(self) -> int:
        """Blocks this rank can hold: an explicit byte budget, or on a GPU what is left of
        gpu_memory_utilization x memory after the weights and a profiled forward pass."""
        budget = self.config.kv_cache_memory_bytes
        if budget is None and self.device.type == "cuda":
            budget = self._profile_cuda_free_bytes()
        if budget is None:  # host memory is shared by all ranks of the replica
            budget = CPU_DEFAULT_KV_BYTES // self.ps.world_size
        return budget // self.block_bytes

    def _profile_cuda_free_bytes(self) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(self.config.max_num_batched_tokens or 2048, self.max_model_len)
        with torch.inference_mode():
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            h = torch.zeros(n, self.model.cfg.hidden_size, dtype=self.dtype, device=self.device)
            dummy_cache = [torch.zeros(2, 1, self.block_size, self.num_kv_heads, self.head_dim,
                                       dtype=self.dtype, device=self.device) for _ in self.model.layers]
            meta = AttentionMetadata(torch.zeros(n, dtype=torch.long, device=self.device),
                                     [PrefillSeq(0, n, 0, None)], n)
            out = self.model(ids, torch.arange(n, device=self.device), dummy_cache, meta, hidden=h)
            if self.ps.is_last_stage:
                self.model.compute_logits(out[-1:])
        self.take_expert_counts()  # the profiling pass is not traffic
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        total = torch.cuda.get_device_properties(self.device).total_memory
        return max(0, int(total * self.config.gpu_memory_utilization) - peak)

    def init_kv_cache(self, num_blocks: int) -> None:
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.model.layers]

    # ---- one step ----------------------------------------------------------------------
    def _prepare(self, step: StepInput):
        bs, dev = self.block_size, self.device
        ids, positions, slots, prefills = [], [], [], []
        decodes = [s for s in step.seqs if len(s.token_ids) == 1]
        ordered = [s for s in step.seqs if len(s.token_ids) > 1] + decodes
        for s in ordered:
            q_start = len(ids)
            ids.extend(s.token_ids)
            pos = range(s.start, s.start + len(s.token_ids))
            positions.extend(pos)
            bt = s.block_table
            slots.extend(bt[p // bs] * bs + p % bs for p in pos)
            if len(s.token_ids) > 1:
                n_blocks = -(-(s.start + len(s.token_ids)) // bs)
                table = torch.tensor(bt[:n_blocks], device=dev) if s.start > 0 else None
                prefills.append(PrefillSeq(q_start, len(ids), s.start, table))
        num_prefill_tokens = len(ids) - len(decodes)
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=dev), prefills, num_prefill_tokens)
        if decodes:
            width = max(-(-(s.start + 1) // bs) for s in decodes)
            tables = torch.tensor([s.block_table[:width] + [0] * (width - min(width, len(s.block_table)))
                                   for s in decodes], dtype=torch.long, device=dev)
            lens = torch.tensor([s.start + 1 for s in decodes], device=dev)
            meta.decode_block_tables = tables
            meta.decode_mask = (torch.arange(width * bs, device=dev)[None, :] < lens[:, None])[:, None, None, :]
            meta.decode_context_lens = lens
        # Row of the last token of each sequence that samples, in the original order.
        last_row, row = {}, 0
        for s in ordered:
            row += len(s.token_ids)
            last_row[s.seq_id] = row - 1
        sample_rows = [last_row[s.seq_id] for s in step.seqs if s.sample]
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(positions, dtype=torch.long, device=dev),
                meta, sample_rows)

    @torch.inference_mode()
    def forward(self, step: StepInput, hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
        """This stage's layers over the step's tokens (token ids on the first stage, the previous
        stage's hidden states on later ones). Returns the hidden states and the rows that sample."""
        ids, positions, meta, sample_rows = self._prepare(step)
        return self.model(ids, positions, self.kv_caches, meta, hidden=hidden), sample_rows

    @torch.inference_mode()
    def sample(self, step: StepInput, hidden_rows: torch.Tensor | None) -> SamplerOutput | None:
        """Last stage: logits of the sampling rows on every TP rank (the vocab-parallel head gathers
        them), tokens on the sampling rank only."""
        if self.sampler is not None:
            self.sampler.forget(step.finished_seq_ids)
        if hidden_rows is None or hidden_rows.shape[0] == 0:
            return None
        logits = self.model.compute_logits(hidden_rows)
        if self.sampler is None:
            return None
        sampling = [s for s in step.seqs if s.sample]
        params = [s.params for s in sampling]
        return self.sampler(logits, [s.seq_id for s in sampling], params, [s.seed_key for s in sampling],
                            [s.history for s in sampling])
