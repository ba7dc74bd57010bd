"""One list of sampling fields: SamplingParams' own, typed once more by the HTTP schema and carried by
the gateway's resumption; a field the client leaves out takes SamplingParams' default."""
from __future__ import annotations

import dataclasses

from meshserve.api.protocol import ChatCompletionRequest, CompletionRequest
from meshserve.gateway import failover
from meshserve.sampling_params import API_PASSTHROUGH_FIELDS, SamplingParams, is_greedy


def test_every_pass_through_field_is_in_the_http_schema_and_means_not_sent_when_absent():
    for schema in (CompletionRequest, ChatCompletionRequest):
        for name in API_PASSTHROUGH_FIELDS:
            assert name in schema.model_fields, (schema.__name__, name)
            assert schema.model_fields[name].default is None, (schema.__name__, name)


def test_the_pass_through_fields_are_every_sampling_field_but_those_each_endpoint_resolves():
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(API_PASSTHROUGH_FIELDS) == names - {"n", "max_tokens", "logprobs", "structured_outputs"}


def test_a_resumed_stream_carries_every_field_but_the_one_it_recounts():
    assert set(failover._CARRIED) == set(API_PASSTHROUGH_FIELDS) - {"min_tokens"}


def test_one_greedy_rule_for_engine_and_gateway():
    assert is_greedy(0) and is_greedy(0.0) and is_greedy(1e-6)
    assert not is_greedy(None) and not is_greedy(0.5)
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams().greedy
