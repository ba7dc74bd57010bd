"""A constraint (StructuredOutputsParams) as an llguidance grammar, validated: one function for the
front end (a 400 naming the field) and the engine (ValueError before a request is queued).

llguidance rather than xgrammar: it needs no transformers or torch at run time (a Rust library with
CPU wheels), takes JSON schemas, regexes, Lark and GBNF grammars and structural tags directly, and
computes a mask in about a millisecond for the grammars the tests use, with no compile step that
depends on the vocabulary beyond the tokenizer it is given once.
"""
from __future__ import annotations

import functools
import json

from meshserve.sampling_params import StructuredOutputsParams

CACHE_SIZE = 256  # distinct constraints kept compiled (front end: validated grammars; engine: parsers)


def grammar_of(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint. ValueError naming what is wrong with it."""
    return _grammar(params.kind, params.text)


@functools.lru_cache(maxsize=CACHE_SIZE)
def _grammar(kind: str, text: str) -> str:
    from llguidance import LLMatcher, grammar_from

    try:
        if kind == "json":
            grammar = LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
        elif kind == "json_object":
            grammar = LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                         defaults={"whitespace_flexible": False})
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(text)
        elif kind == "choice":
            grammar = grammar_from("choice", text)
        elif kind == "grammar":
            grammar = grammar_from("grammar", text)
        else:  # structural_tag: llguidance's own JSON grammar form
            json.loads(text)
            grammar = text
    except (ValueError, TypeError) as exc:
        raise ValueError(f"structured_outputs.{kind} is not valid: {exc}") from None
    problem = LLMatcher.validate_grammar(grammar)
    if problem:
        raise ValueError(f"structured_outputs.{kind} is not valid: {problem.strip().splitlines()[0]}")
    return grammar
