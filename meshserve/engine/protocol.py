"""The engine interface: what the engine process loop (core_proc.py) and `LLM` call on an engine.

`LLMEngine` implements it, and so does every stand-in (the front end's test fake), so the loop
calls methods, never probes for them. Checked statically (mypy) and at run time
(`isinstance(engine, EngineProtocol)` holds for both).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from meshserve.engine.messages import (
    EngineStats,
    KVPrepare,
    LeaseInfo,
    LeaseLedger,
    LeaseRef,
    ModelInfo,
    RequestDelta,
    ReserveRequest,
)
from meshserve.sampling_params import SamplingParams


class UnsupportedCall(Exception):
    """An engine without reservations raises it from reserve/release_lease/leases."""


class TokenizerProtocol(Protocol):
    """What the front end asks of an engine's tokenizer (`meshserve.tokenizer.Tokenizer`; it may also
    read `vocab_size`, `chat_template` and `identity()` where they exist)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str: ...


@runtime_checkable
class EngineProtocol(Protocol):
    @property
    def tokenizer(self) -> TokenizerProtocol: ...

    @property
    def model_info(self) -> ModelInfo: ...

    def config_dict(self) -> dict[str, Any]:
        """The resolved configuration, JSON values only (for /server_info)."""
        ...

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, lease_id: str | None = None, lease_owner: str = "",
                    cache_salt: str = "", kv_transfer: dict[str, Any] | None = None) -> list[int]:
        """Queue a request; its prompt token ids. ValueError (naming the problem) when it cannot be
        served (block_manager.ReservationError when the lease it names cannot cover it or is not
        `lease_owner`'s). `cache_salt` scopes its prefix-cache hits; `kv_transfer` is a hand-off
        descriptor (a prefill engine sends the prompt's K/V where it says)."""
        ...

    def abort_request(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestDelta]: ...

    def get_stats(self) -> EngineStats: ...

    # ---- reservations (UnsupportedCall where there are none) -----------------------------------
    def reserve(self, req: ReserveRequest) -> LeaseInfo | None: ...

    def release_lease(self, ref: LeaseRef) -> bool:
        """End the owner's lease (False: none such); a request drawing on it ends with its error."""
        ...

    def leases(self, owner: str = "") -> LeaseLedger:
        """The block totals and the leases of `owner`."""
        ...

    # ---- KV hand-offs (UnsupportedCall / False on an engine without a --kv-role) ----------------
    def kv_prepare(self, req: KVPrepare) -> dict[str, Any] | None:
        """A decode engine's hand-off descriptor under the owner's lease; None: no room now."""
        ...

    def kv_abort(self, transfer_id: str) -> bool: ...

    # ---- the process around it ----------------------------------------------------------------
    def check_health(self) -> None:
        """Raise if a rank is gone, even while no request runs."""
        ...

    def health_watch(self) -> tuple[list[int], float | None]:
        """What an idle loop waits on besides its inbox (handles that become ready when a rank
        dies), and how often to call check_health when there are none."""
        ...

    def record_ipc(self, seconds: float) -> None:
        """How long the loop took to send the last step's output (the step timeline's "ipc")."""
        ...

    def shutdown(self) -> None: ...
