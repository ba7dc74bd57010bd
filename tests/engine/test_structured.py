"""Structured outputs in the engine: the sampler masks the constrained rows only; a constraint is
compiled once however many requests and samples use it, off the step loop (a request waits for its
parser outside the scheduler, and can be aborted there); every sample of a constrained request
matches; unconstrained requests beside constrained ones sample exactly what they sample alone."""
from __future__ import annotations

import re

import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.layers.sampler import Sampler
from meshserve.sampling_params import StructuredOutputsParams
from meshserve.structured import matchers


def _mask_of(allowed: list[int], vocab: int) -> bytes:
    words = torch.zeros(-(-vocab // 32), dtype=torch.int32)
    for t in allowed:
        words[t // 32] |= (1 << (t % 32)) if t % 32 < 31 else -(1 << 31)
    return words.numpy().tobytes()


def test_the_sampler_masks_constrained_rows_and_leaves_the_others_alone():
    vocab = 100
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=g)
    greedy = SamplingParams(temperature=0)
    sampled = SamplingParams(temperature=1.0, seed=3)
    masks = [None, _mask_of([5, 63, 64], vocab), None, _mask_of([31], vocab)]
    for params in ([greedy] * 4, [sampled] * 4, [greedy, sampled, sampled, greedy]):
        free = Sampler(0)(logits.clone(), [1, 2, 3, 4], params, [7, 8, 9, 10])
        held = Sampler(0)(logits.clone(), [1, 2, 3, 4], params, [7, 8, 9, 10], allowed=masks)
        assert held.token_ids[1] in (5, 63, 64) and held.token_ids[3] == 31
        assert [held.token_ids[0], held.token_ids[2]] == [free.token_ids[0], free.token_ids[2]]


@pytest.fixture(scope="module")
def llm(peaked_model):
    engine = LLM(peaked_model, max_model_len=256, kv_cache_memory_bytes=32 << 20)
    yield engine
    engine.engine.shutdown()


def test_a_constraint_is_compiled_once_and_every_sample_matches(llm, monkeypatch):
    built = []
    real = matchers.StructuredOutputs._build
    monkeypatch.setattr(matchers.StructuredOutputs, "_build", lambda self, g: built.append(g) or real(self, g))
    digits = StructuredOutputsParams(regex=r"[0-9]{2,4}-[a-c]")
    params = [SamplingParams(n=3, temperature=1.0, seed=k, max_tokens=12, structured_outputs=digits) for k in range(4)]
    outs = llm.generate([[5, 6, 7, 8 + k] for k in range(4)], params)
    assert len(built) == 1
    for out in outs:
        for sample in out.outputs:
            assert re.fullmatch(r"[0-9]{2,4}-[a-c]", sample.text) and sample.finish_reason == "stop", sample


def test_unconstrained_rows_beside_constrained_ones_sample_as_alone(llm):
    prompts = [[11, 12, 13], [21, 22, 23, 24], [31, 32]]
    plain = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
             SamplingParams(temperature=0.9, seed=5, max_tokens=10, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3)]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    choice = StructuredOutputsParams(choice=["alpha", "beta", "gamma delta"])
    mixed = llm.generate([[40, 41], *prompts, [50, 51]],
                         [SamplingParams(temperature=0.8, seed=1, structured_outputs=choice), *plain,
                          SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(json_object=True),
                                         max_tokens=30)])
    assert [o.outputs[0].token_ids for o in mixed[1:4]] == alone
    assert mixed[0].outputs[0].text in ("alpha", "beta", "gamma delta")


def test_an_invalid_constraint_is_refused_before_anything_is_queued(llm):
    with pytest.raises(ValueError, match="structured_outputs.regex is not valid"):
        llm.generate([[1, 2]], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
    assert not llm.engine.has_unfinished_requests()


def test_a_request_waiting_for_its_parser_can_be_aborted(llm, monkeypatch):
    import concurrent.futures

    never: concurrent.futures.Future = concurrent.futures.Future()
    monkeypatch.setattr(llm.engine.structured, "compile", lambda params: never)
    engine = llm.engine
    engine.add_request("held", [1, 2, 3], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")))
    assert engine.step() == []  # not scheduled: its parser is not ready
    engine.abort_request("held")
    assert not engine.has_unfinished_requests() and not engine.structured.holding
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks
