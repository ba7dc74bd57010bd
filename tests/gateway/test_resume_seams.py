"""A stream resumed on another replica gives the client the undisturbed run's text, wherever it was
cut: the gateway shows the text of the tokens sent that the failed replica held back (`_gap`), and
the continuation, which prefills those tokens, renders a character cut at the seam whole with its
first output (engine/detokenizer.py). Checked at every cut of texts with multi-byte characters that
the embedded model's byte-level tokenizer splits over several tokens."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from meshserve.engine.detokenizer import IncrementalDetokenizer
from meshserve.gateway.failover import FailureProtocol
from meshserve.models.loader import resolve_model

TEXTS = ["Ǆ ❦ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ done", "தமிழ் உரை", "naïve 🦜🦩 café", "中文测试，好的。"]


@pytest.fixture(scope="module")
def tokenizer():
    return resolve_model("default").load_tokenizer()


def _gap(tokenizer, sent: list[int], seen: str) -> str:
    async def detokenize(attempt, ids):
        return tokenizer.decode(ids)

    shaper = SimpleNamespace(sent_ids=sent, text=seen, text_chunk=lambda text: {"text": text})
    protocol = SimpleNamespace(_detokenize=detokenize)
    chunks = asyncio.run(FailureProtocol._gap(protocol, None, shaper, None))  # type: ignore[arg-type]
    return "".join(c["text"] for c in chunks)


@pytest.mark.parametrize("text", TEXTS)
def test_a_stream_cut_anywhere_reads_as_the_undisturbed_run(tokenizer, text):
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    out = tokenizer.encode(text, add_special_tokens=False)
    assert any(tokenizer.decode([t]).endswith("\ufffd") for t in out)  # the text has characters split over tokens
    for cut in range(len(out)):
        first = IncrementalDetokenizer(tokenizer, True, prompt)
        seen = "".join(first.add(t) for t in out[:cut])  # what the client got before the replica failed
        gap = _gap(tokenizer, out[:cut], seen)
        second = IncrementalDetokenizer(tokenizer, True, prompt + out[:cut])  # the continuation
        rest = "".join(second.add(t) for t in out[cut:]) + second.flush()
        assert "\ufffd" not in seen + gap + rest
        assert seen + gap + rest == tokenizer.decode(out), cut
