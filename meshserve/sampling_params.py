"""SamplingParams: how one request's tokens are chosen and when it stops. Validated on creation."""
from __future__ import annotations

import json as json_lib
from dataclasses import dataclass, fields
from typing import Any

from meshserve.utils.checks import check_range

MAX_LOGPROBS = 20
# Bounds on per-request work: every stop string is searched after every token, and the longest
# one sets how much text is held back from a stream.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
GREEDY_BELOW = 1e-5  # temperatures under this are greedy
# A constraint is compiled into a grammar: its text is bounded like a request body's parts.
MAX_CONSTRAINT_CHARS = 64 * 1024
MAX_CHOICES = 256


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's names): exactly one of a JSON schema (`json`), any JSON
    object (`json_object`), a regular expression, a list of choices, an EBNF/Lark grammar, or a
    structural tag (llguidance's JSON form). Compiled once per distinct constraint (structured/)."""
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, "
                             f"json_object, structural_tag; got {', '.join(given) or 'none'}")
        choice = self.choice
        if choice is not None and not (0 < len(choice) <= MAX_CHOICES and all(isinstance(c, str) for c in choice)):
            raise ValueError(f"structured_outputs.choice must be 1 to {MAX_CHOICES} strings")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object, or its text)")
        if len(self.text) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"structured_outputs.{self.kind} is longer than {MAX_CONSTRAINT_CHARS} characters")

    @property
    def kind(self) -> str:
        return next(name for name in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                    if getattr(self, name) not in (None, False))

    @property
    def text(self) -> str:
        """The constraint as text (a schema as canonical JSON): with `kind`, its identity."""
        value = getattr(self, self.kind)
        if self.kind == "json_object":
            return ""
        if isinstance(value, (dict, list)):
            return json_lib.dumps(value, sort_keys=True, separators=(",", ":"))
        return str(value)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        check_range("n", self.n, 1, 128, integer=True)
        check_range("temperature", self.temperature, 0.0, 100.0)
        check_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        check_range("top_k", self.top_k, integer=True)
        if self.top_k != -1:
            check_range("top_k", self.top_k, 1, integer=True, hint=" or -1 (disabled)")
        check_range("min_p", self.min_p, 0.0, 1.0)
        check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_range("repetition_penalty", self.repetition_penalty, 0.0, 2.0, lo_open=True)
        if self.max_tokens is not None:
            check_range("max_tokens", self.max_tokens, 1, integer=True)
        check_range("min_tokens", self.min_tokens, 0, self.max_tokens, integer=True,
                    hint=" (at most max_tokens)" if self.max_tokens is not None else "")
        if self.logprobs is not None:
            check_range("logprobs", self.logprobs, 0, MAX_LOGPROBS, integer=True)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings of at most "
                             f"{MAX_STOP_STRING_CHARS} characters each, got {len(self.stop)} strings "
                             f"of up to {max(len(s) for s in self.stop)} characters")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, "
                             f"got {len(self.stop_token_ids)}")

    # `stop` and `stop_token_ids` take what a client sends (one string, None); __post_init__ makes
    # them lists, and these read them as such.
    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else self.stop or []

    @property
    def stop_ids(self) -> list[int]:
        return self.stop_token_ids or []

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0


def is_greedy(temperature: float | None) -> bool:
    """The one greedy rule: a temperature this close to 0 takes the most likely token (None: the
    default temperature, 1.0, samples)."""
    return temperature is not None and temperature < GREEDY_BELOW


# Fields the HTTP API takes under the same names and passes on as they are; each endpoint resolves
# n, max_tokens (the room the context leaves), logprobs (completions and chat name it differently)
# and structured_outputs (also from OpenAI's response_format, and from tool_choice).
API_PASSTHROUGH_FIELDS = tuple(f.name for f in fields(SamplingParams)
                               if f.name not in ("n", "max_tokens", "logprobs", "structured_outputs"))
