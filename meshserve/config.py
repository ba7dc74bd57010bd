"""EngineConfig: every engine knob, validated once at the edge with messages a user can act on."""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from meshserve.kv_transfer import KV_ROLES, TRANSPORTS
from meshserve.utils.checks import check_positive_int, check_range
from meshserve.utils.cli_fields import add_flags, flag, values_for
from meshserve.utils.cpuinfo import cpu_bf16_matmul_isa

if TYPE_CHECKING:
    import torch  # at run time imported where needed: building the CLI parser stays fast

_DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
CPU_DEFAULT_KV_BYTES = 4 << 30  # like vLLM's CPU backend: 4 GiB unless told otherwise
# On a CPU a prefill is compute-bound from ~128 rows: more prompt tokens in a step with running
# decodes buy no throughput, only a longer stall of every stream and of the first prompt's token.
CPU_PREFILL_CHUNK_WITH_DECODES = 256
LOAD_FORMATS = ("auto", "dummy")
# vLLM's names. None: what the checkpoint says (a GGUF file's blocks, an fp8 checkpoint's
# quantization_config), else the compute dtype.
QUANTIZATION_METHODS = ("none", "gguf", "int8", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def parse_bytes(text: str) -> int:
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1
    if unit not in units or value <= 0:
        raise argparse.ArgumentTypeError(f"invalid byte size {text!r}: use e.g. 2GiB, 512MiB or 1000000000")
    return int(value * units[unit])


@dataclass
class EngineConfig:
    """Every engine setting; the `flag(...)` fields are also `serve`/`generate` flags (same default)."""
    model: str | None = "default"
    served_model_name: str | None = None
    tokenizer: str | None = flag(None, "HF tokenizer directory, if not the model's own")
    dtype: str = flag("auto", "auto (bf16 on GPUs that support it, else float16; on CPU bf16 for float weights where "
                              "the CPU has AVX512-BF16 or AMX, else float32), float32, "
                              "bfloat16, float16")
    device: str = flag("auto", choices=("auto", "cpu", "cuda"))
    load_format: str = flag("auto", choices=LOAD_FORMATS)
    quantization: str | None = flag(
        None, "weights as stored or made at load: none (dequantized to --dtype), gguf (a GGUF file's blocks "
              "as stored; the default for .gguf models), int8 (weight-only, per-output-channel scales, made "
              "at load), fp8 (e4m3 with per-channel scales: an fp8 checkpoint's own, or made at load); "
              "default: what the checkpoint holds", choices=QUANTIZATION_METHODS, aliases=("-q",))
    kv_cache_dtype: str = flag("auto", "the KV cache's element type: auto (the compute dtype), fp8 / fp8_e4m3, "
                                       "fp8_e5m2 (one byte per value, twice the tokens per byte)",
                               choices=KV_CACHE_DTYPES)
    seed: int = flag(0)
    max_model_len: int | None = flag(None, type=int)
    max_num_seqs: int = flag(256)
    max_num_batched_tokens: int | None = flag(None, type=int)
    block_size: int = flag(16)
    enable_prefix_caching: bool = flag(True)
    enable_chunked_prefill: bool = flag(True)
    # None: `meshserve serve` on a CPU takes CPU_PREFILL_CHUNK_WITH_DECODES (serving_defaults).
    prefill_chunk_with_decodes: int | None = flag(
        None, "while sequences decode, new prompts join a step at most N tokens at a time (lower inter-token "
              "latency for running streams, later first tokens for long prompts; 0: no cap; default: `serve` "
              f"on a CPU {CPU_PREFILL_CHUNK_WITH_DECODES}, otherwise no cap)", type=int, metavar="N")
    # Off by default: at 0.5-1 req/s on a 2-core CPU, 1.5 quadrupled TTFT p50 (docs/performance.md).
    decode_stall_ratio: float | None = flag(
        None, "while sequences decode, a step's prompt work is sized so that the step takes at most R times a "
              "decode-only step, as predicted by a step-cost model fitted on the engine's own steps (bounds "
              "inter-token gaps at the cost of later first tokens; 0 or unset: off)", type=float, metavar="R")
    kv_cache_memory_bytes: int | None = flag(None, "KV cache budget per rank, e.g. 2GiB or 500000000",
                                             name="--kv-cache-memory", type=parse_bytes, metavar="BYTES")
    gpu_memory_utilization: float = flag(0.9)
    tensor_parallel_size: int = flag(1, aliases=("-tp",))
    pipeline_parallel_size: int = flag(1, aliases=("-pp",))
    pipeline_split: list[int] | None = flag(None, "layers per pipeline stage (default: even)",
                                            type=lambda s: [int(x) for x in s.split(",")], metavar="N,N,...")
    enable_expert_parallel: bool = flag(
        False, "MoE models: split whole experts over the TP ranks (EP size = TP size, the same devices: "
               "TP x PP ranks in all, never TP x PP x EP); attention stays TP")
    distributed_executor_backend: str = flag("mp", choices=("mp", "ray"))
    profile: bool = flag(False, "at shutdown, print per-rank compute vs communication time (all-reduce, send/recv)")
    profile_dir: str | None = flag(None, "also write a torch.profiler trace per worker and the summary table here")
    step_trace: str | None = flag(None, "append one JSON line per engine step to FILE: start time, prompt tokens, "
                                        "sequences decoding, context tokens and the time of each phase",
                                  metavar="FILE")
    kv_role: str = flag("both", "prefill|decode: this engine's side of a disaggregated KV hand-off (both: the "
                                "colocated engine)", choices=KV_ROLES)
    kv_transport: str = flag("tcp", "how K/V travel between a prefill and a decode engine (tcp between any hosts; "
                                    "pg: torch.distributed, NCCL between GPUs; inproc: one process)",
                             choices=TRANSPORTS)
    kv_host: str = flag("127.0.0.1", "the address a decode engine receives K/V on")
    kv_port: int = flag(0, "the port a decode engine receives K/V on (0: any free port)")
    async_scheduling: bool = flag(False, "schedule and launch the next step while the current one runs, rendering "
                                         "the current step's text meanwhile (helps where the forward runs on a "
                                         "GPU; not with --kv-role prefill/decode)")
    enforce_eager: bool = flag(False, "CUDA: run every step eagerly instead of replaying CUDA graphs for "
                                      "decode steps")

    def __post_init__(self) -> None:
        self.dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not _cuda_available():
            raise ValueError("device='cuda' was requested but no CUDA device is available")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, "
                             f"got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        for name in ("max_num_seqs", "block_size", "tensor_parallel_size", "pipeline_parallel_size"):
            check_positive_int(name, getattr(self, name))
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        if self.prefill_chunk_with_decodes is not None:
            check_range("prefill_chunk_with_decodes", self.prefill_chunk_with_decodes, 0, integer=True,
                        hint=" (a token count; 0: no cap)")
        ratio = self.decode_stall_ratio
        # Below 1 no step with prompt work could fit: a budget smaller than the decodes alone.
        if ratio is not None and (ratio != 0 or isinstance(ratio, bool)):
            check_range("decode_stall_ratio", ratio, 1.0, hint=" (or 0: off)")
        check_range("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, lo_open=True)
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError("distributed_executor_backend must be 'mp' or 'ray', "
                             f"got {self.distributed_executor_backend!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_transport not in TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {', '.join(TRANSPORTS)}, got {self.kv_transport!r}")
        check_range("kv_port", self.kv_port, 0, 65535, integer=True)
        if self.async_scheduling and self.kv_role != "both":
            raise ValueError("async_scheduling does not combine with a kv_role: a hand-off reads the KV cache "
                             "between steps")
        if self.pipeline_split is not None and len(self.pipeline_split) != self.pipeline_parallel_size:
            raise ValueError(f"pipeline_split has {len(self.pipeline_split)} entries but "
                             f"pipeline_parallel_size is {self.pipeline_parallel_size}")

    # ---- resolved values --------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def resolved_device(self) -> torch.device:
        import torch
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        return self.dtype_choice()[0]

    def dtype_choice(self) -> tuple[torch.dtype, str]:
        """(torch dtype, why): the dtype asked for, or what `auto` picks on this device."""
        import torch
        if self.dtype != "auto":
            return getattr(torch, self.dtype), "set by dtype"
        device = self.resolved_device()
        quantized = self.quantization not in (None, "none")  # resolved from the model by the engine
        name, why = auto_dtype(device.type, device.type == "cuda" and _cuda_bf16_supported(device), quantized)
        return getattr(torch, name), why

    def serving_defaults(self) -> EngineConfig:
        """A served engine's defaults where the setting is left open: on a CPU, prompts join
        running decodes at most CPU_PREFILL_CHUNK_WITH_DECODES tokens at a time (a GPU's prefill
        gains from larger batches, and an offline batch from fewer, fuller steps: no cap there)."""
        if self.prefill_chunk_with_decodes is None and self.resolved_device().type == "cpu":
            return replace(self, prefill_chunk_with_decodes=CPU_PREFILL_CHUNK_WITH_DECODES)
        return self

    def batched_token_budget(self, max_model_len: int) -> int:
        """Tokens one step may compute: max_num_batched_tokens, or 2048 (with chunked prefill) /
        enough for a whole prompt of max_model_len (without)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 2048 if self.enable_chunked_prefill else max(2048, max_model_len)

    def to_dict(self) -> dict:
        return asdict(self)

    # ---- CLI --------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser, with_model: bool = True) -> None:
        if with_model:
            p.add_argument("model", nargs="?", default="default",
                           help="'default' (embedded SmolLM2-135M-Instruct), a .gguf file, a HF model "
                                "directory, or a config.json with --load-format dummy")
        add_flags(p.add_argument_group("engine"), EngineConfig)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**values_for(cls, args))


def auto_dtype(device_type: str, bf16_supported: bool, quantized: bool = False) -> tuple[str, str]:
    """What dtype='auto' means on a device (for float weights, or `quantized` ones), and why."""
    if device_type != "cuda":
        if quantized:
            return "float32", ("auto on CPU with quantized weights: float32 activations (the integer kernels round "
                               "them to int8 either way, and float32 prefills faster around them)")
        isa = cpu_bf16_matmul_isa()
        if isa:
            return "bfloat16", (f"auto on CPU: this CPU multiplies bfloat16 natively ({isa}): half the bytes per "
                                "decode step, and oneDNN's bfloat16 GEMMs outrun float32's")
        return "float32", ("auto on CPU: without AVX512-BF16 or AMX (on this CPU, or allowed by ONEDNN_MAX_CPU_ISA), "
                           "bfloat16 decodes one sequence faster (half the bytes) but prefills and decodes "
                           "batches of 4 or more slower than float32")
    if bf16_supported:
        return "bfloat16", "auto on a GPU with native bf16: fp32's range at half the bytes"
    return "float16", "auto on a GPU without native bf16 (before Ampere): float16"


def _cuda_bf16_supported(device: torch.device) -> bool:
    import torch
    with torch.cuda.device(device):  # emulated bf16 (pre-Ampere) runs far slower than float16
        try:
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
        except TypeError:  # an older torch, without including_emulation: native bf16 is Ampere on
            return torch.cuda.get_device_capability(device)[0] >= 8


def _cuda_available() -> bool:
    import torch  # imported here so that building the CLI parser stays fast
    return torch.cuda.is_available()
