"""Incremental detokenization: several tokens at once read as the same text as one at a time."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshserve.engine.detokenizer import IncrementalDetokenizer
from meshserve.models.loader import resolve_model

# Characters that byte-level BPE splits over tokens, words, digits, and whitespace runs.
TEXTS = ["naïve 🦜🦩 café", "中文测试，好的。", "Hello, world!  \n\tdef f(x): return x ** 2", "தமிழ் உரை 123"]


@pytest.fixture(scope="module")
def tokenizer():
    return resolve_model("default").load_tokenizer()


@pytest.fixture(scope="module")
def partial_ids(tokenizer):
    """Tokens whose bytes end inside a character (alone they decode to a replacement character)."""
    return [t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]).endswith("\ufffd")]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_tokens_in_groups_read_as_one_at_a_time(tokenizer, partial_ids, data, skip):
    """Any mix of encoded text (characters split over tokens), random ids, tokens that end inside a
    character, special tokens and prompt contexts, cut into groups of any sizes: each group's text is
    what its tokens one by one give, and so is the flush."""
    vocab = tokenizer.vocab_size
    pieces = data.draw(st.lists(st.one_of(
        st.sampled_from(TEXTS).map(lambda t: tokenizer.encode(t, add_special_tokens=False)),
        st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6),
        st.lists(st.sampled_from(partial_ids), min_size=1, max_size=4),
        st.lists(st.sampled_from([tokenizer.eos_token_id or 0, 0, 1, 2]), min_size=1, max_size=2)),
        min_size=1, max_size=5))
    ids = [t for p in pieces for t in p]
    prompt = data.draw(st.sampled_from([[], tokenizer.encode("Say:", add_special_tokens=False),
                                        tokenizer.encode("🦜", add_special_tokens=False)[:1]]))
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(ids)), max_size=6))) | {0, len(ids)})
    grouped, single = IncrementalDetokenizer(tokenizer, skip, prompt), IncrementalDetokenizer(tokenizer, skip, prompt)
    for a, b in zip(cuts, cuts[1:]):  # group by group, the same text
        assert grouped.add_many(ids[a:b]) == "".join(single.add(t) for t in ids[a:b])
    assert grouped.flush() == single.flush()


def test_a_group_is_two_decodes(tokenizer, monkeypatch):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4, add_special_tokens=False)
    calls = []
    real = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    d = IncrementalDetokenizer(tokenizer, True, [])
    text = d.add_many(ids) + d.flush()
    assert text == real(ids) and len(calls) <= 4  # the group, then the flush
