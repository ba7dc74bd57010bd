"""Request bodies of the OpenAI-compatible API, validated strictly: wrong types and unknown fields are 400s.

Fields beyond OpenAI's (top_k, min_p, repetition_penalty, ignore_eos, ...) follow vLLM's names so that
clients written for vLLM work unchanged. Ranges are checked once, by SamplingParams.
"""
from __future__ import annotations

from typing import Any, Literal, TypeGuard

from pydantic import BaseModel, ConfigDict, Field

from meshserve.sampling_params import MAX_LOGPROBS

MAX_CACHE_SALT_CHARS = 256
MAX_TOOLS = 128  # OpenAI's limit on `tools`
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
# torch generators take 64-bit seeds.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False


class StructuredOutputsField(StrictModel):
    """vLLM's `structured_outputs`: exactly one constraint (sampling_params.StructuredOutputsParams)."""
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None


class JsonSchemaFormat(StrictModel):
    """OpenAI's `response_format.json_schema`."""
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's `response_format`: text (no constraint), any JSON object, or a JSON schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(StrictModel):
    """What completions and chat completions share. The sampling fields are SamplingParams' own
    (sampling_params.API_PASSTHROUGH_FIELDS, a test holds the two together): None means "not sent",
    and SamplingParams' default applies."""
    model: str | None = None
    n: int = 1
    # vLLM's field: the request's prefix-cache hits are only on blocks cached under the same salt.
    cache_salt: str | None = Field(default=None, max_length=MAX_CACHE_SALT_CHARS)
    # What the output must match: OpenAI's response_format, or vLLM's structured_outputs.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM-style extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None


# str, a batch of str, one prompt as token ids, or a batch of token-id prompts
Prompt = str | list[str] | list[int] | list[list[int]]


def is_text_batch(prompt: Prompt) -> TypeGuard[list[str]]:
    """A validated prompt list holds one kind of item, so its first tells which (an empty list is
    none of the three)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str)


def is_token_ids(prompt: Prompt) -> TypeGuard[list[int]]:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)


def is_token_batch(prompt: Prompt) -> TypeGuard[list[list[int]]]:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], list)


class CompletionRequest(SamplingFields):
    prompt: Prompt
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    # A prefill replica's hand-off: the descriptor a decode replica made (POST /v1/kv/transfers).
    kv_transfer_params: dict[str, Any] | None = None


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    """A call an assistant message made (sent back in the history)."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # role "tool": the call it answers


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class ToolDefinition(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    """`tool_choice` naming the one function the answer must call."""
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # Tool calling (server/tools.py). tool_choice None: "auto" when tools are given, else "none".
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(StrictModel):
    """A text prompt, or chat messages rendered with the chat template first (vLLM's two shapes)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    # As a chat request renders them (vLLM's /tokenize takes them too): the prompt a gateway sizes
    # and routes by is the one the replica will run.
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None


class ReservationRequest(StrictModel):
    """POST /v1/reservations: the KV blocks a request will need, asked for before it is sent."""
    prompt_token_ids: list[int] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    n: int = Field(default=1, ge=1, le=128)
    ttl_s: float = Field(default=30.0, gt=0, le=3600)  # an unused lease ends after this long
    request_id: str = Field(default="", max_length=128)
    attempt_id: str = Field(default="", max_length=64)
    cache_salt: str | None = Field(default=None, max_length=MAX_CACHE_SALT_CHARS)


class KVTransferRequest(StrictModel):
    """POST /v1/kv/transfers on a decode replica: the destination blocks of a prompt's K/V, under a
    reservation the caller holds there."""
    lease_id: str = Field(min_length=1, max_length=128)
    prompt_token_ids: list[int] = Field(min_length=1)
    cache_salt: str | None = Field(default=None, max_length=MAX_CACHE_SALT_CHARS)
    request_id: str = Field(default="", max_length=128)
    attempt_id: str = Field(default="", max_length=64)


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]
