"""Everything that crosses the engine-process boundary, as types. Both sides dispatch on the type.

Front end -> engine (`EngineOp`, a list of them per pipe message):
  `AddRequest`      queue a request (optionally drawing on a lease this engine granted)
  `AbortRequests`   stop requests wherever they are (unknown ids are ignored)
  `EngineCall`      a question with an answer (`CallMethod`: reserve, release, leases)
  `Shutdown`        stop the loop and the ranks

Engine -> front end (`EngineEvent`, one per pipe message):
  `EngineReady`     the model is loaded: its `ModelInfo`, the tokenizer, the resolved configuration
  `StepOutput`      one step: its timestamp, a `RequestDelta` per request that moved, `EngineStats`
  `StatsUpdate`     the engine's figures changed while idle (after aborts, say)
  `CallReply`       the answer to an `EngineCall`: a result, or a `CallError` with its kind
  `RequestRejected` an `AddRequest` the engine refused, with the `RejectKind`
  `EngineFatal`     the process is ending (`FatalKind`: it crashed, or refused its configuration)

A call is answered between steps, so a grant and the requests the scheduler admits never
interleave: the engine's ledger is the one authority on its KV. Neither side imports the other's
process code; both import this module.
"""
from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

from meshserve.outputs import RequestMetrics
from meshserve.sampling_params import SamplingParams


# ---- payloads -------------------------------------------------------------------------------
@dataclass(slots=True)
class ReserveRequest:
    """Ask for the KV blocks of a request before sending it: its prompt, output budget and samples."""
    prompt_token_ids: list[int]
    max_tokens: int
    n: int = 1
    ttl_s: float = 30.0  # an unused lease ends after this long
    request_id: str = ""  # the client's request and attempt, recorded in the ledger
    attempt_id: str = ""
    cache_salt: str = ""  # the prefix it may find cached is its salt's (see AddRequest)
    owner: str = ""  # who asks (a digest of the API key): only the owner may use, see or end the lease
    max_owner_leases: int | None = None  # leases one owner may hold at once (None: no bound)


@dataclass(slots=True)
class KVPrepare:
    """A decode engine's destination blocks for a prompt's K/V, under the owner's lease (KV_PREPARE)."""
    lease_id: str
    prompt_token_ids: list[int]
    owner: str = ""
    request_id: str = ""
    attempt_id: str = ""


@dataclass(slots=True)
class LeaseRef:
    """A lease named by its owner (RELEASE): another owner's lease is as good as unknown."""
    lease_id: str
    owner: str = ""


class ErrorCode(enum.Enum):
    """Why the engine ended a request early (RequestDelta.error_code)."""
    STEP_FAILED = "engine_step_failed"                # a step it was in raised
    RESERVATION_RELEASED = "reservation_released"   # the lease it drew on was released under it
    KV_TRANSFER_FAILED = "kv_transfer_failed"       # its KV hand-off to the decode engine failed


@dataclass(slots=True)
class LeaseInfo:
    """One lease as the ledger shows it (POST and GET /v1/reservations)."""
    lease_id: str
    request_id: str
    attempt_id: str
    blocks: int
    pinned_blocks: int
    taken_blocks: int
    bound: bool
    expires_in_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class LeaseLedger:
    """An engine's whole ledger: its blocks and every live lease."""
    num_blocks: int
    block_size: int
    free_blocks: int
    reserved_blocks: int
    held_back_blocks: int
    peak_reserved_blocks: int
    leases: list[LeaseInfo]


@dataclass(slots=True)
class SampleDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(slots=True)
class RequestDelta:
    """What one step added to a request: the samples that moved. The last delta of a request has
    `finished`, the engine-side timestamps, and for a request that failed (finish_reason "error")
    the reason."""
    request_id: str
    outputs: list[SampleDelta]
    finished: bool
    error: str | None = None
    error_code: ErrorCode | None = None
    metrics: RequestMetrics | None = None
    kv_transfer: dict[str, Any] | None = None  # a prefill request's hand-off: bytes, seconds, error


@dataclass(kw_only=True)
class EngineStats:
    """An engine's figures after a step: what /metrics, the load report and routing read."""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    reserved_blocks: int = 0  # promised to leases (see BlockManager.reserved_blocks)
    held_back_blocks: int = 0  # free blocks held back for leases: the rest are anyone's
    num_leases: int = 0
    pending_prefill_tokens: int = 0  # prompt tokens admitted or waiting that are not computed yet
    block_size: int = 16
    last_step_compute_s: float = 0.0
    last_step_comm_s: float = 0.0
    # Per-rank compute/communication seconds (last step and totals): Executor.timing_snapshot().
    parallel_timing: dict[str, Any] = field(default_factory=dict)
    # MoE models: tokens routed to each expert of each layer ({} for dense): Executor.expert_load_snapshot().
    expert_load: dict[str, Any] = field(default_factory=dict)
    # Seconds of the last step in each phase (engine/step_timeline.py); "ipc" is added by the engine process.
    step_phases: dict[str, float] = field(default_factory=dict)
    # KV hand-offs, cumulative (kv_transfer/connector.py stats()); {} on a colocated engine.
    kv_transfer: dict[str, float] = field(default_factory=dict)

    @property
    def unpromised_free_blocks(self) -> int:
        """Free blocks that no lease has a claim on."""
        return self.num_free_blocks - self.held_back_blocks

    def same_state(self, other: EngineStats | None) -> bool:
        """The same figures, the last step's phase times aside (they are no news once idle)."""
        return other is not None and {**asdict(self), "step_phases": None} == {**asdict(other), "step_phases": None}


@dataclass(slots=True)
class ModelInfo:
    """What the front end needs to know of the served model."""
    id: str
    max_model_len: int
    revision: str | None = None
    vocab_size: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- front end -> engine --------------------------------------------------------------------
@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    lease_id: str | None = None  # a KV reservation granted by this engine
    lease_owner: str = ""  # who sends it: the lease must be theirs
    # Prefix-cache scope: blocks cached under one salt are never a hit for another (per tenant).
    cache_salt: str = ""
    kv_transfer: dict[str, Any] | None = None  # a prefill engine's hand-off descriptor


@dataclass(slots=True)
class AbortRequests:
    request_ids: list[str]


class CallMethod(enum.Enum):
    RESERVE = "reserve"   # argument: ReserveRequest; result: LeaseInfo, or None when it does not fit
    RELEASE = "release"   # argument: LeaseRef; result: whether it existed (and was the owner's)
    LEASES = "leases"     # argument: the owner; result: LeaseLedger of that owner's leases
    PING = "ping"         # no argument; result: True, answered by the engine loop between steps
    KV_PREPARE = "kv_prepare"  # argument: KVPrepare; result: the descriptor (dict), or None: no room now
    KV_ABORT = "kv_abort"      # argument: a transfer id; result: whether this engine had it


@dataclass(slots=True)
class EngineCall:
    reply_id: int
    method: CallMethod
    argument: Any = None


@dataclass(slots=True)
class Shutdown:
    pass


EngineOp = AddRequest | AbortRequests | EngineCall | Shutdown


# ---- engine -> front end --------------------------------------------------------------------
@dataclass(slots=True)
class EngineReady:
    model: ModelInfo
    tokenizer: Any = field(repr=False)
    config: dict[str, Any] = field(default_factory=dict)  # the engine's resolved configuration (JSON values)


@dataclass(slots=True)
class StepOutput:
    timestamp: float  # the engine process's time.monotonic() when the step ended
    deltas: list[RequestDelta]
    stats: EngineStats


@dataclass(slots=True)
class StatsUpdate:
    stats: EngineStats


class CallErrorKind(enum.Enum):
    UNSUPPORTED = "unsupported"  # this engine does not answer the method (no reservations)
    INVALID = "invalid"          # the argument is wrong (its message names it)
    LIMIT = "limit"              # the caller holds as much as it may (leases per owner)
    NOT_FOUND = "not_found"      # the lease it names does not exist (ended, expired, another owner's)


@dataclass(slots=True)
class CallError:
    kind: CallErrorKind
    message: str


@dataclass(slots=True)
class CallReply:
    reply_id: int
    result: Any = None
    error: CallError | None = None


class RejectKind(enum.Enum):
    INVALID = "invalid"          # the request itself is wrong: the client's to fix
    RESERVATION = "reservation"  # the lease it names cannot cover it: the caller's to redo


@dataclass(slots=True)
class RequestRejected:
    request_id: str
    message: str
    kind: RejectKind = RejectKind.INVALID


class FatalKind(enum.Enum):
    CRASHED = "crashed"                # restart it
    INVALID_CONFIG = "invalid_config"  # it would refuse the same configuration again


@dataclass(slots=True)
class EngineFatal:
    message: str
    kind: FatalKind = FatalKind.CRASHED


EngineEvent = EngineReady | StepOutput | StatsUpdate | CallReply | RequestRejected | EngineFatal
