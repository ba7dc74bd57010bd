"""Structured outputs through the official openai client on the embedded model: seeded random JSON
schemas sampled at temperature > 0 always give answers that parse and validate; regexes and choices
match whole; streaming equals non-streaming for a seeded request; unconstrained requests served
beside constrained ones answer exactly what they answer alone; a bad constraint is a 400 naming
its field; a constraint that max_tokens cuts short ends with `length`, its text a valid prefix."""
from __future__ import annotations

import asyncio
import json
import random
import re

import httpx
import jsonschema
import openai
import pytest
from server_helpers import ServerProcess

from meshserve.models.loader import resolve_model

MODEL = "SmolLM2-135M-Instruct"


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Nested objects with required and optional fields, bounded arrays, enums, ranged numbers."""
    r = rng.random()
    if depth < 2 and r < 0.3:
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randrange(0, 2),
                "maxItems": rng.randrange(2, 4)}
    if depth < 2 and r < 0.6:
        props = {f"f{i}": random_schema(rng, depth + 1) for i in range(rng.randrange(1, 4))}
        required = rng.sample(list(props), rng.randrange(len(props) + 1))
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    kind = rng.choice(["integer", "number", "string", "enum", "boolean"])
    if kind in ("integer", "number"):
        lo = rng.randrange(-50, 50)
        return {"type": kind, "minimum": lo, "maximum": lo + rng.randrange(1, 1000)}
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randrange(2, 12)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", "ok", "no"], rng.randrange(1, 4))}
    return {"type": "boolean"}


@pytest.fixture(scope="module")
def server():
    resolve_model("default")
    # Float32 weights, whose outputs do not depend on how a step is batched (docs/quantization.md).
    s = ServerProcess(["-m", "meshserve", "serve", "--max-model-len", "1024", "--kv-cache-memory", "100000000",
                       "--quantization", "none", "--dtype", "float32", "--log-level", "warning"], startup_timeout=300)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_seeded_random_schemas_always_give_valid_json(server):
    rng = random.Random(20261202)
    schemas = [{"type": "object", "properties": {"a": random_schema(rng), "b": random_schema(rng)},
                "required": ["a"], "additionalProperties": False} for _ in range(6)]

    async def one(aclient, i, schema):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        answer = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe something as JSON."}], max_tokens=400,
            temperature=0.8, seed=i, response_format=fmt)
        return answer.choices[0]

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(aclient, i, s) for i, s in enumerate(schemas)))

    for schema, choice in zip(schemas, asyncio.run(run())):
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_regex_choice_and_json_object_match_whole(client):
    pattern = r"[A-Z][a-z]{2,6} [0-9]{1,3}"
    for seed in range(3):
        text = client.completions.create(model=MODEL, prompt="A name and a number:", max_tokens=20, temperature=0.9,
                                         seed=seed, extra_body={"structured_outputs": {"regex": pattern}})
        text = text.choices[0].text
        assert re.fullmatch(pattern, text), text
        picked = client.completions.create(model=MODEL, prompt="Best fruit:", max_tokens=10, temperature=1.0, seed=seed,
                                           extra_body={"structured_outputs": {"choice": ["apple", "kiwi", "fig"]}})
        assert picked.choices[0].text in ("apple", "kiwi", "fig")
    obj = client.chat.completions.create(model=MODEL, max_tokens=200, temperature=0, response_format={
        "type": "json_object"}, messages=[{"role": "user", "content": "Give a JSON object with a name and an age."}])
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_streaming_equals_non_streaming_for_a_seeded_request(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
              "required": ["city", "population"], "additionalProperties": False}
    request = {"model": MODEL, "messages": [{"role": "user", "content": "A city as JSON"}], "max_tokens": 100,
               "temperature": 0.7, "seed": 11, "response_format": {"type": "json_schema",
                                                                    "json_schema": {"name": "c", "schema": schema}}}
    whole = client.chat.completions.create(**request).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**request, stream=True)
                       if c.choices)
    assert streamed == whole and jsonschema.validate(json.loads(whole), schema) is None


def test_unconstrained_requests_beside_constrained_ones_answer_as_alone(server):
    plain = [{"prompt": f"The {w} is", "max_tokens": 12, "temperature": 0} for w in ("sea", "moon", "forest")]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as h:
            alone = [(await h.post("/v1/completions", json=b)).json()["choices"][0]["text"] for b in plain]
            constrained = [h.post("/v1/completions", json={"prompt": f"JSON {k}:", "max_tokens": 40, "temperature": 0.9,
                                                            "seed": k, "structured_outputs": {"json_object": True}})
                           for k in range(6)]
            mixed = await asyncio.gather(*constrained, *(h.post("/v1/completions", json=b) for b in plain))
            return alone, [r.json()["choices"][0]["text"] for r in mixed[6:]]

    alone, beside = asyncio.run(run())
    assert beside == alone


@pytest.mark.parametrize("body,param", [
    ({"structured_outputs": {"regex": "([a-z"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
])
def test_a_bad_constraint_is_a_400_naming_its_field(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_constraint_cut_short_by_max_tokens_ends_with_length_and_a_valid_prefix(client):
    answer = client.completions.create(model=MODEL, prompt="Say a lot:", max_tokens=5, temperature=0,
                                       extra_body={"structured_outputs": {"regex": "(ab){40}"}}).choices[0]
    assert answer.finish_reason == "length" and re.fullmatch(r"(ab)*a?", answer.text) and answer.text
