"""What a request's output must match, read from its HTTP fields: OpenAI's `response_format`
(`json_object`, `json_schema`) or vLLM's `structured_outputs` (one of json, regex, choice, grammar,
json_object, structural_tag). One of the two at most; a 400 naming the field otherwise."""
from __future__ import annotations

import json

from meshserve.api.errors import APIError, bad_request
from meshserve.api.protocol import SamplingFields
from meshserve.sampling_params import StructuredOutputsParams


def constraint_of(req: SamplingFields) -> StructuredOutputsParams | None:
    fmt, so = req.response_format, req.structured_outputs
    wants_format = fmt is not None and fmt.type != "text"
    if wants_format and so is not None:
        raise bad_request("send response_format or structured_outputs, not both", param="structured_outputs")
    try:
        if so is not None:
            tag = so.structural_tag
            return StructuredOutputsParams(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar, json_object=so.json_object,
                structural_tag=json.dumps(tag) if isinstance(tag, dict) else tag)
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema",
                              param="response_format")
        return StructuredOutputsParams(json=fmt.json_schema.schema_)
    except ValueError as exc:
        param = "structured_outputs" if so is not None else "response_format"
        raise APIError(400, str(exc), param=param, code="invalid_parameter") from None
