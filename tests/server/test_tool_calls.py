"""Tool calls on /v1/chat/completions: the parsers on crafted text, rendering with and without a
template that knows tools, and a real `meshserve serve` (embedded model) driven by the openai client
as a vLLM user's code drives it: named and required tool_choice (every sampled call valid against
its schema), tool results rendered back, streaming equal to a body, and the 400s."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_helpers import ServerProcess
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from meshserve.api.protocol import ChatCompletionRequest
from meshserve.models.loader import resolve_model
from meshserve.server.server_config import ServerConfig
from meshserve.server.serving import _message
from meshserve.server.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    JsonToolParser,
    NamedToolParser,
    ParsedCall,
    RequiredToolParser,
    ToolParser,
    parse_tool_calls,
)
from meshserve.server.tools import for_template, plan_tools, template_knows_tools
from meshserve.tokenizer import Tokenizer

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TIME_SCHEMA = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30},
                                                "hour24": {"type": "boolean"}},
               "required": ["timezone"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')} somewhere",
                                           "parameters": schema}} for name, schema in SCHEMAS.items()]
WEATHER = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
ARGS = '{"city": "Paris", "unit": "celsius"}'
CALL = f'{{"name": "get_weather", "arguments": {ARGS}}}'
MODEL = "SmolLM2-135M-Instruct"


# ---- parsers ----------------------------------------------------------------------------------------
def streamed(parser: ToolParser, text: str, step: int = 1) -> tuple[str, list[ParsedCall]]:
    content, calls = [], []
    for i in range(0, len(text), step):
        shown, found = parser.feed(text[i:i + step])
        content.append(shown)
        calls += found
    shown, found = parser.finish()
    return "".join(content) + shown, calls + found


def both(make, text: str) -> tuple[str, list[ParsedCall]]:
    """The whole-text answer, checked equal to streaming it a character (and three) at a time."""
    whole = parse_tool_calls(make(), text)
    assert streamed(make(), text) == whole
    assert streamed(make(), text, 3) == whole
    return whole


def hermes():
    return HermesToolParser(list(SCHEMAS))


def test_hermes_reads_calls_anywhere_and_keeps_the_text_around_them():
    text = f'Let me look.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>{{"name": "get_time", "arguments": ' \
           '{"timezone": "CET"}}</tool_call>\nOne moment.'
    content, calls = both(hermes, text)
    assert content == "Let me look.\nOne moment."
    assert calls == [ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                     ParsedCall("get_time", '{"timezone": "CET"}')]


def test_hermes_answer_of_only_calls_has_no_content_and_a_list_in_one_block_is_several_calls():
    text = '\n<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "parameters": ' \
           '{"city": "Oslo"}}]</tool_call>\n'
    content, calls = both(hermes, text)
    assert content == ""
    assert [c.name for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "Oslo"}


def test_hermes_malformed_or_unknown_calls_stay_content():
    for text in ['<tool_call>{"name": "get_weather", "arguments": {city: Paris}}</tool_call> sorry',
                 'Before <tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',
                 '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>["get_weather"]</tool_call>',
                 'an unclosed <tool_call>{"name": "get_weather", "argu', 'ends in a half tag <tool_c',
                 'plain text with trailing space  \n']:
        assert both(hermes, text) == (text, []), text


def test_hermes_accepts_an_unclosed_last_block_and_holds_back_a_possible_opening():
    assert both(hermes, f"<tool_call>\n{CALL}\n") == ("", [ParsedCall("get_weather",
                                                                         '{"city": "Paris", "unit": "celsius"}')])
    parser = hermes()
    assert parser.feed("Hi <tool") == ("Hi", [])  # neither the half tag nor the space before it
    assert parser.feed("box>") == (" <toolbox>", [])


def test_json_parser_reads_a_whole_answer_of_calls_else_content():
    def json_parser():
        return JsonToolParser(list(SCHEMAS))

    assert both(json_parser, f" {CALL}\n") == ("", [ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}')])
    content, calls = both(json_parser, '[{"name": "get_time", "parameters": {"timezone": "UTC"}}, '
                                       '{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}]')
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"timezone": "UTC"}), ("get_weather", {"city": "Rome"})]
    for text in ['{"name": "get_weather", "arguments": {"city": ', '{"answer": 42}', 'Sure: ' + CALL, '[]',
                 f"{CALL} and more", '{"name": "nope", "arguments": {}}']:
        assert both(json_parser, text) == (text, []), text
    parser = json_parser()
    assert parser.feed("No JSON here") == ("No JSON here", [])  # plain text streams at once


def test_forced_parsers_read_what_the_constraint_allows():
    assert both(lambda: NamedToolParser("get_time"), '{"timezone": "UTC"}') == (
        "", [ParsedCall("get_time", '{"timezone": "UTC"}')])
    assert both(lambda: NamedToolParser("get_time"), '{"timezone": "U') == ('{"timezone": "U', [])  # cut off
    content, calls = both(lambda: RequiredToolParser(list(SCHEMAS)),
                          '[{"name": "get_time", "parameters": {"timezone": "UTC"}}, '
                          '{"name": "get_weather", "parameters": {}}]')
    assert content == "" and [c.name for c in calls] == ["get_time", "get_weather"]


def test_the_parser_flag_and_its_registry():
    assert {"hermes", "json"} <= set(TOOL_PARSERS) and ServerConfig().tool_call_parser == "hermes"
    assert ServerConfig(tool_call_parser="json").tool_call_parser == "json"
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ServerConfig(tool_call_parser="nope")


# ---- planning and rendering ---------------------------------------------------------------------------
def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, **fields})


def test_forced_choices_become_json_schema_constraints():
    named = plan_tools(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}),
                       "hermes")
    assert named.constraint is not None and named.constraint.json == TIME_SCHEMA
    bare = [{"type": "function", "function": {"name": "ping"}}]
    assert plan_tools(request(tools=bare, tool_choice={"type": "function", "function": {"name": "ping"}}),
                      "hermes").constraint.json == {"type": "object"}
    required = plan_tools(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), "hermes")
    schema = required.constraint.json
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    branches = schema["items"]["anyOf"]
    assert [(b["properties"]["name"]["enum"], b["properties"]["parameters"]) for b in branches] == [
        (["get_weather"], WEATHER_SCHEMA), (["get_time"], TIME_SCHEMA)]
    assert "maxItems" not in plan_tools(request(tools=TOOLS, tool_choice="required"), "hermes").constraint.json
    auto = plan_tools(request(tools=TOOLS), "json")
    assert auto.choice == "auto" and auto.constraint is None and isinstance(auto.parser(), JsonToolParser)
    none = plan_tools(request(tools=TOOLS, tool_choice="none"), "hermes")
    assert none.tools is None and none.parser() is None
    assert plan_tools(request(), "hermes").choice == "none"


HISTORY = [*ASK,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
           {"role": "tool", "tool_call_id": "call_a", "content": "21 degrees, sunny"},
           {"role": "tool", "tool_call_id": "call_b", "content": "a second result"}]


def test_a_template_without_tools_gets_them_written_into_the_messages():
    req = request(messages=[{"role": "system", "content": "Be brief."}, *HISTORY], tools=TOOLS)
    msgs, tools = for_template([_message(m) for m in req.messages], plan_tools(req, "hermes").tools, False)
    assert tools is None
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("Be brief.\n\n")
    assert "<tools>" in msgs[0]["content"] and json.dumps(TOOLS[0]) in msgs[0]["content"]
    assert msgs[2] == {"role": "assistant", "content": f"<tool_call>\n{CALL}\n</tool_call>"}
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n21 degrees, sunny\n</tool_response>\n"
                                                  "<tool_response>\na second result\n</tool_response>"}
    assert len(msgs) == 4
    plain, _ = for_template([_message(m) for m in request(messages=HISTORY).messages], None, False)
    assert plain[0] == ASK[0]  # no tools: no system message added


def test_a_template_that_knows_tools_renders_them_itself():
    template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{{ '\\n' }}{% endif %}"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.city }}]"
                "{% endfor %}{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}")
    tok = Tokenizer(HFTokenizer(models.BPE()), chat_template=template, bos_token=None, eos_token=None, add_bos=False)
    assert template_knows_tools(template)
    assert not template_knows_tools(resolve_model("default").load_tokenizer().chat_template)
    req = request(messages=HISTORY, tools=TOOLS)
    msgs, tools = for_template([_message(m) for m in req.messages], plan_tools(req, "hermes").tools, True)
    text = tok.apply_chat_template(msgs, add_generation_prompt=False, tools=tools)
    assert text.splitlines() == ["TOOLS:get_weather;get_time;", ASK[0]["role"] + ":" + ASK[0]["content"],
                                 "assistant:[call get_weather Paris]", "tool:21 degrees, sunny(call_a)",
                                 "tool:a second result(call_b)"]


# ---- the real server ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    resolve_model("default")  # the one-time GGUF conversion, before the server wants it
    s = ServerProcess(["-m", "meshserve", "serve", "--max-model-len", "1024", "--kv-cache-memory", "100000000",
                       "--log-level", "warning"], startup_timeout=300)
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def arguments_of(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_a_named_tool_call_has_arguments_valid_for_its_schema(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=WEATHER, n=2,
                                         temperature=0.9, seed=11, max_tokens=200)
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        arguments_of(call)
    assert out.choices[0].message.tool_calls[0].id != out.choices[1].message.tool_calls[0].id


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_name_real_tools_with_valid_arguments(client, parallel):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What time is it in Tokyo, and how warm is it there?"}],
        tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel, n=3, temperature=0.9, seed=5,
        max_tokens=300)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = choice.message.tool_calls
        assert len(calls) == 1 if not parallel else len(calls) >= 1
        for call in calls:
            assert call.function.name in SCHEMAS
            arguments_of(call)
        assert len({c.id for c in calls}) == len(calls)


def test_streaming_a_named_call_equals_the_body(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0.9, seed=1234, max_tokens=200,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    body = client.chat.completions.create(**kwargs)
    [expected] = body.choices[0].message.tool_calls
    calls, finish, content = [], None, ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert content == "" and finish == "tool_calls"
    [call] = calls
    assert call.index == 0 and call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, call.function.arguments) == ("get_time", expected.function.arguments)
    arguments_of(call)


def test_auto_reads_hermes_calls_from_the_answer_streamed_or_not(client):
    """The model is made to write a hermes block (a constraint on the text); auto parses it."""
    answer = f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>"
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, n=2, temperature=0.5, seed=3, max_tokens=100,
                  extra_body={"structured_outputs": {"choice": [answer]}})
    body = client.chat.completions.create(**kwargs)
    for choice in body.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert arguments_of(call) == {"city": "Paris", "unit": "celsius"}
    content, calls, finish = ["", ""], [[], []], [None, None]
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            assert "<" not in (choice.delta.content or "")  # no part of a block is shown as content
            content[choice.index] += choice.delta.content or ""
            calls[choice.index] += choice.delta.tool_calls or []
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert content == ["Let me check."] * 2 and finish == ["tool_calls"] * 2
    for got in calls:
        [call] = got
        assert call.index == 0 and (call.function.name, json.loads(call.function.arguments)) == (
            "get_weather", {"city": "Paris", "unit": "celsius"})


def test_tool_choice_none_answers_in_plain_text(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8,
                                         temperature=0)
    assert out.choices[0].message.tool_calls == [] and out.choices[0].finish_reason in ("stop", "length")
    assert out.choices[0].message.content


def test_a_tool_result_is_rendered_into_the_follow_up(client, server):
    out = client.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=16, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with httpx.Client(base_url=server.url, timeout=60) as http:
        tokens = http.post("/tokenize", json={"messages": HISTORY}).json()["tokens"]
        prompt = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert "<tool_response>\n21 degrees, sunny\n</tool_response>" in prompt
    assert f"<tool_call>\n{CALL}\n</tool_call>" in prompt
    assert prompt.count("<tool_response>") == 2


@pytest.mark.parametrize("fields,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": WEATHER}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": f"t{i}"}} for i in range(129)]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strange"}}}],
      "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "x"}]}, "messages"),
])
def test_bad_tool_fields_are_400s_naming_the_field(client, fields, param):
    body = {"messages": ASK, **fields}
    messages = body.pop("messages")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_body=body)
    assert err.value.status_code == 400 and err.value.param == param, err.value.body


def test_auto_without_parallel_tool_calls_keeps_the_first_call(client):
    two = f'<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{{"name": "get_time", "arguments": {{}}}}\n</tool_call>'
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, parallel_tool_calls=False, max_tokens=100,
                  extra_body={"structured_outputs": {"choice": [two]}})
    [choice] = client.chat.completions.create(**kwargs).choices
    assert choice.message.content is None and [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    streamed_calls = [c for chunk in client.chat.completions.create(**kwargs, stream=True)
                      for ch in chunk.choices for c in ch.delta.tool_calls or []]
    assert [c.function.name for c in streamed_calls] == ["get_weather"]
