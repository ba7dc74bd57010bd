"""Hypothesis strategies for batches that mix every sampling option, and the checks every request of
such a batch must pass. Shared by the offline (LLM) and the server property tests."""
from __future__ import annotations

import os

from hypothesis import strategies as st

from meshserve.sampling_params import SamplingParams


def examples(default: int) -> int:
    """How many batches a property test draws: `default` in the suite, more with
    MESHSERVE_FUZZ_EXAMPLES=500 pytest ..."""
    env = os.environ.get("MESHSERVE_FUZZ_EXAMPLES")
    return int(env) if env else default


# Ordinary text tokens of the embedded tokenizer, and short strings that decoded text often contains.
TOKENS = st.integers(1000, 20000)
STOP_TEXTS = st.sampled_from(["e", "a", " the", "in", "s ", "\n", "ing", "."])


@st.composite
def sampling_params(draw) -> SamplingParams:
    greedy = draw(st.booleans())
    max_tokens = draw(st.integers(1, 12))
    return SamplingParams(
        n=draw(st.integers(1, 3)),
        temperature=0.0 if greedy else draw(st.sampled_from([0.3, 0.8, 1.0, 1.7])),
        top_p=draw(st.sampled_from([1.0, 0.95, 0.5])),
        top_k=draw(st.sampled_from([-1, 1, 5, 40])),
        min_p=draw(st.sampled_from([0.0, 0.05, 0.5])),
        seed=draw(st.none() | st.integers(0, 2**31 - 1)),
        presence_penalty=draw(st.sampled_from([0.0, 0.0, 1.5, -1.0])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.0, 0.7, -0.4])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.3, 0.8])),
        logprobs=draw(st.none() | st.integers(0, 4)),
        stop=draw(st.lists(STOP_TEXTS, max_size=2)),
        stop_token_ids=draw(st.lists(TOKENS, max_size=2)),
        include_stop_str_in_output=draw(st.booleans()),
        min_tokens=draw(st.integers(0, max_tokens)),
        ignore_eos=draw(st.booleans()),
        skip_special_tokens=draw(st.booleans()),
        max_tokens=max_tokens,
    )


@st.composite
def prompt_batches(draw, max_requests: int = 5) -> list[list[int]]:
    """1..max_requests token-id prompts; some share a prefix of a full block or more."""
    shared = draw(st.lists(TOKENS, min_size=16, max_size=40))
    prompts = []
    for _ in range(draw(st.integers(1, max_requests))):
        own = draw(st.lists(TOKENS, min_size=1, max_size=24))
        prompts.append(shared + own if draw(st.booleans()) else own)
    return prompts


def is_reproducible(p: SamplingParams) -> bool:
    """Outputs that do not depend on what else is in the batch: greedy, or sampled with a seed."""
    return p.greedy or p.seed is not None


def check_sample(token_ids: list[int], text: str, finish_reason: str | None, stop_reason, p: SamplingParams) -> None:
    assert finish_reason in ("stop", "length"), finish_reason
    assert len(token_ids) <= p.max_tokens
    if finish_reason == "length":
        assert len(token_ids) == p.max_tokens
    else:
        assert len(token_ids) >= max(1, p.min_tokens)
    if isinstance(stop_reason, str):
        assert stop_reason in p.stop
        if p.include_stop_str_in_output:
            assert text.endswith(stop_reason)
        elif p.min_tokens == 0:  # the first occurrence stopped it, and is cut off
            assert stop_reason not in text
    elif stop_reason is not None:
        assert stop_reason in p.stop_token_ids and token_ids[-1] == stop_reason
