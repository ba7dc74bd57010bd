"""ModelRunner: owns one rank's model shard and KV cache; turns a step's sequences into tensors,
runs the forward pass and (on the last pipeline stage's first TP rank) samples.

Attention runs on the backend chosen for the device (layers/attention/registry.py). On CUDA the
runner also sizes the KV cache from a profile of the worst steps (memory_budget.py) and, where the
backend allows, replays decode steps from CUDA graphs (cuda_graphs.py)."""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch

from meshserve.config import CPU_DEFAULT_KV_BYTES, EngineConfig
from meshserve.distributed.expert_load import ExpertLoadRecorder
from meshserve.distributed.parallel_state import get_parallel_state
from meshserve.layers import cpu_kernels
from meshserve.layers.attention import AttentionSpec, kv_cache_dtype, select_backend
from meshserve.layers.cpu_gemm import panel_bytes, panel_max_rows, prepack_model, warm_up_packed
from meshserve.layers.host_to_device import to_device
from meshserve.layers.moe import SparseMoeBlock
from meshserve.layers.quantization.assemble import assemble_quantized
from meshserve.layers.sampler import Sampler, SamplerOutput, constrained, takes_argmax
from meshserve.models.geometry import kv_block_bytes, kv_element_bytes
from meshserve.models.llama import LlamaForCausalLM
from meshserve.models.loader import ModelSource
from meshserve.models.model_config import ModelConfig
from meshserve.models.registry import model_class
from meshserve.sampling_params import SamplingParams
from meshserve.utils import huge_pages
from meshserve.utils.heap import keep_freed_heap, release_free_heap
from meshserve.worker.cuda_graphs import DecodeGraphInputs, DecodeGraphs, capture_sizes, graphs_disabled_reason
from meshserve.worker.memory_budget import (
    DeviceMemoryProfile,
    KVCacheBudget,
    decode_step,
    plan_kv_cache,
    profile_steps,
)
from meshserve.worker.step import StepInput
from meshserve.worker.step_packing import PackedStep, pack_step
from meshserve.worker.weight_report import describe_weights

logger = logging.getLogger(__name__)


def _init_dummy_(model: torch.nn.Module, seed: int, device: torch.device) -> None:
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.data.fill_(1.0)
        else:
            p.data.copy_(torch.randn(p.shape, generator=g, device=device, dtype=p.dtype) * 0.02)


def _build_model(cls: type[LlamaForCausalLM], cfg: ModelConfig, split: list[int] | None, device: torch.device,
                 dtype: torch.dtype, dummy: bool) -> LlamaForCausalLM:
    """Loaded weights on CPU: built in float32 and cast afterwards, as always. On a GPU, or with dummy
    weights (a big geometry, an MoE's experts), built on the device in the final dtype: an 8B model
    in float32 on the host would need 32 GB there."""
    if device.type != "cuda" and not dummy:
        return cls(cfg, split)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # rotary tables ask for float32 explicitly and stay float32
    try:
        with torch.device(device):
            return cls(cfg, split)
    finally:
        torch.set_default_dtype(previous)


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int):
        self.config = config
        self.ps = get_parallel_state()
        self.device = self.ps.device
        self.dtype, dtype_reason = config.dtype_choice()
        if self.ps.rank == 0:
            logger.info("dtype %s (%s)", str(self.dtype).removeprefix("torch."), dtype_reason)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        # The KV cache's elements: the compute dtype, or fp8 (--kv-cache-dtype), one byte each.
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        if self.ps.rank == 0:
            logger.info("KV cache dtype %s (--kv-cache-dtype %s)", str(self.kv_dtype).removeprefix("torch."),
                        config.kv_cache_dtype)
        cfg = source.config
        torch.manual_seed(config.seed)
        dummy = config.load_format == "dummy"
        model = _build_model(model_class(cfg.architecture), cfg, config.pipeline_split, self.device, self.dtype, dummy)
        method = config.quantization or "none"  # resolved by the engine
        if dummy:
            _init_dummy_(model, config.seed + self.ps.rank, self.device)
        else:
            model.load_weights(source.iter_weights(method))
        self.weight_bytes = assemble_quantized(model, method, self.device, self.dtype)
        release_free_heap()
        logger.info("rank %d: quantization %s: %s", self.ps.rank, method,
                    describe_weights(model, cfg, self.weight_bytes, self.ps, self.dtype, config.enable_expert_parallel))
        self.model = model.to(device=self.device).eval()
        for p in self.model.parameters():
            p.data = p.data.to(self.dtype)  # buffers (rotary tables) stay float32: bf16 positions lose precision
        if self.device.type == "cpu" and self.dtype in cpu_kernels.DTYPES:
            cpu_kernels.available()  # compile (or load) them now, not during the first request
        arena = prepack_model(self.model)
        if arena is not None and self.ps.rank == 0:
            logger.info("linear weights streamed by decode steps: %.0f MiB in one block, %s", arena.nbytes / 2 ** 20,
                        "on transparent huge pages" if arena.huge else
                        f"on plain pages (transparent huge pages: {huge_pages.thp_mode() or 'none'})")
        if self.device.type == "cpu":
            panels = panel_bytes(self.model)
            if panels and self.ps.rank == 0:
                bf16 = self.dtype == torch.bfloat16
                isa = (cpu_kernels.panel_bf16_isa() if bf16 else cpu_kernels.panel_isa()).upper()
                logger.info("linear layers of up to %d rows take weight panels (%s; csrc/panel_gemm.cpp): "
                            "%.0f MiB more host memory", panel_max_rows(self.dtype), isa, panels / 2 ** 20)
            self._warm_up_matmuls()
        if getattr(self.model, "cpu_stack", None) is not None and self.ps.rank == 0:
            logger.info("decoder layers run as one C++ loop (models/cpu_decoder_stack.py)")
        self.sampler = Sampler(config.seed, self.device) if self.ps.is_last_stage and self.ps.tp_rank == 0 else None
        attn = next(iter(self.model.decoder_layers())).self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.kv_caches: list[torch.Tensor] = []
        self.attn_backend = select_backend(self.device, AttentionSpec(attn.num_heads, attn.num_kv_heads,
                                                                      self.block_size))
        no_graphs = graphs_disabled_reason(self.device.type, config.enforce_eager, self.attn_backend, self.model)
        max_decode_batch = min(config.max_num_seqs, config.batched_token_budget(max_model_len))
        self.graph_sizes = capture_sizes(max_decode_batch) if no_graphs is None else []
        if self.device.type == "cuda" and no_graphs is not None and self.ps.rank == 0:
            logger.info("decode steps run eagerly: %s", no_graphs)
        self.graphs: DecodeGraphs | None = None
        # Per forward of this step on the last stage: a replay's (logits, argmax) of all its rows,
        # else None; sample() takes them when the step was that one replay.
        self._step_heads: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self.kv_budget: KVCacheBudget | None = None  # the measured breakdown, on CUDA
        # MoE routing counts: every rank of a stage sees the same global counts, its first TP rank reports them.
        self.expert_load: ExpertLoadRecorder | None = (getattr(self.model, "expert_load", None)
                                                       if self.ps.tp_rank == 0 else None)

    def _warm_up_matmuls(self) -> None:
        """oneDNN's primitives for the row counts of steps that run beside decodes (a prompt chunk
        plus every running sequence), built now rather than by the first requests that meet them."""
        cfg = self.config
        rows = min(cfg.batched_token_budget(self.max_model_len),
                   (cfg.prefill_chunk_with_decodes or 0) + cfg.max_num_seqs)
        t0 = time.perf_counter()
        calls = warm_up_packed(self.model, rows, cfg.max_num_seqs)
        if calls and self.ps.rank == 0:
            logger.info("built the matmuls for up to %d rows in %.1f s", rows, time.perf_counter() - t0)

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
        elem = kv_element_bytes(self.config.kv_cache_dtype, self.dtype.itemsize)
        assert elem == self.kv_dtype.itemsize, "the geometry's rule and the allocation agree"
        return kv_block_bytes(len(self.model.layers), self.num_kv_heads, self.head_dim, self.block_size, elem)

    def num_kv_blocks(self) -> int:
        """Blocks this rank can hold: an explicit byte budget, or on a GPU what the profiled
        breakdown leaves of gpu_memory_utilization x memory (see memory_budget.py)."""
        budget = self.config.kv_cache_memory_bytes
        if budget is None and self.device.type == "cuda":
            self.kv_budget = self._profile_cuda_budget()
            logger.info("rank %d: %s", self.ps.rank, self.kv_budget.describe())
            return self.kv_budget.num_blocks
        if budget is None:  # host memory is shared by all ranks of the replica
            budget = CPU_DEFAULT_KV_BYTES // self.ps.world_size
        return budget // self.block_bytes

    def _dummy_kv_cache(self) -> list[torch.Tensor]:
        shape = (2, 1, self.block_size, self.num_kv_heads, self.head_dim)
        return [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in self.model.layers]

    @torch.inference_mode()
    def run_profile_steps(self, kv_caches: list[torch.Tensor]) -> None:
        """The scheduler's worst steps (memory_budget.profile_steps) through forward and sampling,
        on a one-block cache; every rank of the replica runs them together (they communicate)."""
        tokens = self.config.batched_token_budget(self.max_model_len)
        for step in profile_steps(tokens, self.config.max_num_seqs, self.max_model_len, self.block_size):
            packed = pack_step(step, self.block_size)
            hidden = None
            if not self.ps.is_first_stage:
                hidden = torch.zeros(packed.num_tokens, self.model.cfg.hidden_size, dtype=self.dtype,
                                     device=self.device)
            out = self._run_eager(packed, hidden, kv_caches)
            if self.ps.is_last_stage:
                self.sample(step, out[to_device(packed.sample_rows, torch.long, self.device)])
                if self.sampler is not None:
                    self.sampler.forget([s.seq_id for s in step.seqs])
        self.take_expert_counts()  # the profiling steps are not traffic

    def _profile_cuda_budget(self) -> KVCacheBudget:
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        weights = torch.cuda.memory_allocated(dev)
        dummy_cache = self._dummy_kv_cache()
        self.run_profile_steps(dummy_cache)
        torch.cuda.synchronize(dev)
        activation_peak = torch.cuda.max_memory_allocated(dev) - weights
        slack = max(0, torch.cuda.max_memory_reserved(dev) - torch.cuda.max_memory_allocated(dev))
        graph_bytes = 0
        if self.graph_sizes:  # the graphs' pool holds one decode forward at the largest size
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            with torch.inference_mode():
                decode = pack_step(decode_step(max(self.graph_sizes), self.max_model_len, self.block_size),
                                   self.block_size)
                hidden = None if self.ps.is_first_stage else torch.zeros(
                    decode.num_tokens, self.model.cfg.hidden_size, dtype=self.dtype, device=dev)
                out = self._run_eager(decode, hidden, dummy_cache)
                if (head := self._graph_head()) is not None:  # captured with the forward
                    head(out).argmax(-1)
            torch.cuda.synchronize(dev)
            graph_bytes = torch.cuda.max_memory_allocated(dev) - base
        del dummy_cache
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        non_torch = max(0, (total - free) - torch.cuda.memory_reserved(dev))
        profile = DeviceMemoryProfile(total, weights, activation_peak, non_torch, graph_bytes, slack)
        return plan_kv_cache(profile, self.config.gpu_memory_utilization, self.block_bytes,
                             spare_blocks=1 if self.graph_sizes else 0)

    def init_kv_cache(self, num_blocks: int) -> None:
        """With CUDA graphs one spare block past `num_blocks` takes the padding rows' K/V."""
        spare = 1 if self.graph_sizes else 0
        shape = (2, num_blocks + spare, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [self._zeroed_cache(shape) for _ in self.model.layers]
        if self.device.type == "cpu":  # what loading left is given back once; what steps free is kept
            release_free_heap()
            if keep_freed_heap() and self.ps.rank == 0:
                logger.info("freed step buffers stay in the heap (glibc mallopt): no page faults per step")
        if self.graph_sizes:
            self._capture_graphs(pad_block=num_blocks)

    def _zeroed_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        # A CPU decode step reads every sequence's blocks, scattered through its layer's cache: on
        # huge pages those reads miss the TLB far less (decode attention 1.01-1.16x faster, six
        # rounds taking turns on a 2-core Xeon). A cache under one huge page stays on plain pages.
        if self.device.type == "cpu" and math.prod(shape) * self.kv_dtype.itemsize >= huge_pages.HUGE_PAGE_BYTES:
            return huge_pages.zeros(shape, self.kv_dtype)
        return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    def _capture_graphs(self, pad_block: int) -> None:
        t0 = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        hidden_size = None if self.ps.is_first_stage else self.model.cfg.hidden_size
        inputs = DecodeGraphInputs(max(self.graph_sizes), -(-self.max_model_len // self.block_size), pad_block,
                                   self.block_size, self.device, hidden_size, self.dtype)
        self.graphs = DecodeGraphs(self.model, self.kv_caches, inputs, self.graph_sizes, self.attn_backend,
                                   head=self._graph_head())
        self.graphs.capture()
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("rank %d: captured CUDA graphs for decode batches %s in %.1f s (%.2f GiB; budgeted %.2f GiB)",
                    self.ps.rank, self.graph_sizes, time.perf_counter() - t0, used / 2**30,
                    (self.kv_budget.profile.cuda_graph_bytes if self.kv_budget else 0) / 2**30)

    def _graph_head(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The LM head to capture with decode graphs: the last stage's, without tensor parallelism
        (whose vocab-parallel head gathers logits across ranks, left to the eager path)."""
        return self.model.compute_logits if self.ps.is_last_stage and self.ps.tp_size == 1 else None

    # ---- one step ----------------------------------------------------------------------
    def _run_eager(self, packed: PackedStep, hidden: torch.Tensor | None, kv_caches: list[torch.Tensor]):
        ids, positions, meta = self.attn_backend.build_inputs(packed)
        return self.model(ids, positions, kv_caches, meta, hidden=hidden)

    @torch.inference_mode()
    def forward(self, step: StepInput, hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
        """This stage's layers over the step's tokens (token ids on the first stage, the previous
        stage's hidden states on later ones). Returns the hidden states and the rows that sample."""
        packed = pack_step(step, self.block_size)
        if self.graphs is not None and self.graphs.can_run(packed):
            out = self.graphs.run(packed, hidden)
            if self.ps.is_last_stage:
                every_row = packed.sample_rows == list(range(len(packed.decode_context_lens)))
                self._step_heads.append(self.graphs.last_head if every_row else None)
            return out, packed.sample_rows
        if self.ps.is_last_stage:
            self._step_heads.append(None)
        return self._run_eager(packed, hidden, self.kv_caches), packed.sample_rows

    @torch.inference_mode()
    def sample(self, step: StepInput, hidden_rows: torch.Tensor | None) -> SamplerOutput | None:
        """Last stage: logits of the sampling rows on every TP rank (the vocab-parallel head gathers
        them), tokens on the sampling rank only."""
        heads, self._step_heads = self._step_heads, []
        if self.sampler is not None:
            self.sampler.forget(step.finished_seq_ids)
        if hidden_rows is None or hidden_rows.shape[0] == 0:
            return None
        head = heads[0] if len(heads) == 1 else None  # two micro-batches' replays share the graph's memory
        sampling = [s for s in step.seqs if s.sample]
        params: list[SamplingParams] = []
        for s in sampling:
            assert s.params is not None, "the engine sends the params of every sequence that samples"
            params.append(s.params)
        allowed = [s.allowed for s in sampling]
        logits, greedy = (None, None) if head is None else head
        if head is None and self.sampler is not None and takes_argmax(params) and not constrained(allowed):
            greedy = self.model.greedy_tokens(hidden_rows)  # no logits at all where the LM head can
        if logits is None and greedy is None:
            logits = self.model.compute_logits(hidden_rows)
        if self.sampler is None:
            return None
        return self.sampler(logits, [s.seq_id for s in sampling], params, [s.seed_key for s in sampling],
                            [s.history for s in sampling], allowed, greedy=greedy)
