"""The output budget rule both front ends apply before any model work: prompt plus output must fit
the model's context."""
from __future__ import annotations

from meshserve.api.errors import bad_request

# A UTF-8 character is at most 4 bytes, so a byte-level tokenizer splits one over at most 4 tokens:
# how far back a stream cut inside a character must look (the detokenizer, the gateway's resumption).
MAX_CHAR_TOKENS = 4
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat: the rest of the context


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, default: int | None) -> int:
    """`requested`, or `default` (None: the rest of the context), checked against the context."""
    room = max_model_len - prompt_len
    if room < 1:
        raise bad_request(f"the prompt has {prompt_len} tokens, which leaves no room for output in "
                          f"this model's context of {max_model_len} tokens", param="prompt",
                          code="context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    if requested < 1:
        raise bad_request(f"max_tokens must be at least 1, got {requested}", param="max_tokens")
    if requested > room:
        raise bad_request(f"the prompt has {prompt_len} tokens and max_tokens is {requested}: "
                          f"{prompt_len + requested} is over this model's context of "
                          f"{max_model_len} tokens", param="max_tokens",
                          code="context_length_exceeded")
    return requested
