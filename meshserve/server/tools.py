"""Tool calling on /v1/chat/completions: the request's tools and tool_choice checked and turned into
what to render, what to constrain the output to, and how to read calls back out of it.

- tool_choice "none": no tools are rendered and the answer is plain text.
- "auto": the tools are rendered and the answer is read by `--tool-call-parser` (tool_parsers.py);
  without parallel_tool_calls only its first call is kept.
- "required": the output is constrained to a JSON list of `{"name", "parameters"}` objects, each
  name with its own function's schema (one item at most without parallel_tool_calls).
- a named function: the output is constrained to that function's arguments.

Rendering: a chat template that mentions `tools` gets them (a list of the tool dicts, as Hugging
Face templates expect) and renders tool calls and results itself; for any other template the tools
are written into the system message, Hermes style (a `<tools>` block and how to answer with
`<tool_call>` blocks), assistant calls become such blocks and tool results `<tool_response>` blocks
in a user turn.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from meshserve.api.errors import APIError, bad_request
from meshserve.api.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, ToolDefinition
from meshserve.sampling_params import StructuredOutputsParams
from meshserve.server.tool_parsers import (
    DEFAULT_TOOL_PARSER,
    HERMES_CLOSE,
    HERMES_OPEN,
    TOOL_PARSERS,
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
)
from meshserve.structured.grammars import grammar_of

ANY_OBJECT: dict[str, Any] = {"type": "object"}

TOOLS_PROMPT = """# Tools

You can call functions to answer. Their definitions, as JSON, are inside <tools></tools>:
<tools>
{tools}
</tools>

To call a function, answer with a JSON object of its name and arguments inside <tool_call></tool_call> \
tags, one block per call:
<tool_call>
{{"name": <function name>, "arguments": <arguments object>}}
</tool_call>"""


@dataclass
class ToolPlan:
    """What a chat request's tool fields mean for its prompt, its output and its answer."""
    choice: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]] | None  # to render (None: none)
    names: list[str]
    constraint: StructuredOutputsParams | None = None
    named: str | None = None
    parser_name: str = DEFAULT_TOOL_PARSER
    max_calls: int | None = None  # 1 without parallel_tool_calls: later calls are dropped

    def parser(self) -> ToolParser | None:
        """A fresh parser for one choice of the answer (None: the answer is plain text)."""
        if self.choice == "named" and self.named is not None:
            return NamedToolParser(self.named)
        if self.choice == "required":
            return RequiredToolParser(self.names)
        if self.choice == "auto":
            return TOOL_PARSERS[self.parser_name](self.names)
        return None


def parameters_schema(tool: ToolDefinition) -> dict[str, Any]:
    return tool.function.parameters or ANY_OBJECT


def required_schema(tools: list[ToolDefinition], parallel: bool) -> dict[str, Any]:
    """A list of calls, each `{"name": one tool's name, "parameters": that tool's arguments}`."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": parameters_schema(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def rendered_tools(tools: list[ToolDefinition] | None, tool_choice: object) -> list[dict[str, Any]] | None:
    """The tools a prompt shows the model: all of them, unless tool_choice is "none" (or absent
    without tools). The one rule for chat requests and /tokenize."""
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if choice == "none" or not tools:
        return None
    return [t.model_dump(exclude_none=True) for t in tools]


def plan_tools(req: ChatCompletionRequest, parser_name: str) -> ToolPlan:
    """Check the tool fields (a 400 naming the field) and decide what they ask for."""
    tools = req.tools or []
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise bad_request(f"tools: the function name {dup!r} is given more than once", param="tools")
    for i, m in enumerate(req.messages):
        if m.tool_calls is not None and m.role != "assistant":
            raise bad_request(f"messages[{i}]: only assistant messages have tool_calls", param="messages")
        if m.tool_call_id is not None and m.role != "tool":
            raise bad_request(f"messages[{i}]: only tool messages have a tool_call_id", param="messages")
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise bad_request("tool_choice needs tools: send the functions it may call", param="tool_choice")
    if choice == "none":
        return ToolPlan("none", None, names)
    rendered = rendered_tools(tools, choice)
    if choice == "auto":
        return ToolPlan("auto", rendered, names, parser_name=parser_name,
                        max_calls=None if req.parallel_tool_calls else 1)
    if (req.response_format is not None and req.response_format.type != "text") or req.structured_outputs is not None:
        raise bad_request("a tool_choice that forces a call decides the output's format: send it without "
                          "response_format or structured_outputs", param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        tool = next((t for t in tools if t.function.name == name), None)
        if tool is None:
            raise bad_request(f"tool_choice names the function {name!r}, which is not in tools", param="tool_choice")
        plan = ToolPlan("named", rendered, names, StructuredOutputsParams(json=parameters_schema(tool)), name)
    else:
        plan = ToolPlan("required", rendered, names,
                        StructuredOutputsParams(json=required_schema(tools, req.parallel_tool_calls)))
    assert plan.constraint is not None
    try:
        grammar_of(plan.constraint)
    except ValueError as exc:
        raise APIError(400, f"tools: a function's parameters are not a usable JSON schema: {exc}", param="tools",
                       code="invalid_parameter") from None
    return plan


# ---- rendering ------------------------------------------------------------------------------------
def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in str(template)


def tool_calls_of(m: ChatMessage) -> list[dict[str, Any]]:
    """An assistant message's calls as chat templates take them: the arguments as an object where
    they are JSON (as Hugging Face templates expect), else the text sent."""
    calls = []
    for c in m.tool_calls or ():
        try:
            args: Any = json.loads(c.function.arguments)
        except ValueError:
            args = c.function.arguments
        calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
    return calls


def _call_block(call: dict[str, Any]) -> str:
    fn = call["function"]
    body = json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False)
    return f"{HERMES_OPEN}\n{body}\n{HERMES_CLOSE}"


def tools_block(tools: list[dict[str, Any]]) -> str:
    return TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def for_template(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 knows_tools: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages (serving._message's dicts) and `tools` argument to render: as they are for a
    template that knows tools, else with the tools, calls and results written out as text."""
    if knows_tools:
        return messages, tools
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "assistant" and m.get("tool_calls"):
            blocks = "\n".join(_call_block(c) for c in m["tool_calls"])
            out.append({"role": role, "content": f"{content}\n{blocks}" if content else blocks})
        elif role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # results of one turn's calls share one user turn
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_results": True})
        else:
            out.append({"role": role, "content": content})
    for m in out:
        m.pop("tool_results", None)
    if tools:
        block = tools_block(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None
