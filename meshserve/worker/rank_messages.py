"""What crosses the engine-to-rank channel of the multi-process executors, as types.

Engine -> rank: `RankCall`, a `RankMethod` of the Worker and its arguments (`execute` takes the
step's StepInput, worker/step.py). Rank -> engine (over a pipe; Ray returns values and raises
instead): `RankReply` with the method's result (`execute`: a RankStepOutput), `RankStepFailed` when
the step raised but the rank serves on, `RankCrashed` when the rank is gone (its traceback).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class RankMethod(enum.Enum):
    NUM_KV_BLOCKS = "num_kv_blocks"  # () -> int
    INIT_KV_CACHE = "init_kv_cache"  # (num_blocks,) -> None
    EXECUTE = "execute"              # (StepInput,) -> RankStepOutput
    EXPORT_KV = "export_kv"          # (block_ids,) -> KVPart (worker/kv_blocks.py)
    IMPORT_KV = "import_kv"          # (block_ids, WireTensor of the canonical blocks) -> None
    CLOSE = "close"                  # () -> None; the rank then exits


@dataclass(frozen=True, slots=True)
class RankCall:
    method: RankMethod
    args: tuple = ()

    def apply(self, worker) -> Any:
        return getattr(worker, self.method.value)(*self.args)


@dataclass(slots=True)
class RankReply:
    value: Any = None


@dataclass(slots=True)
class RankStepFailed:
    traceback: str


@dataclass(slots=True)
class RankCrashed:
    traceback: str


RankAnswer = RankReply | RankStepFailed | RankCrashed
