"""Structured outputs: what a request's output must match (a JSON schema, a regex, a choice list, a
grammar), compiled with llguidance into a token mask applied in the sampler to the constrained
rows only. grammars.py turns a constraint into a validated grammar (the front end refuses a bad one
with a 400 before anything is queued); matchers.py keeps each constrained sequence's parser in the
engine, compiles off the step loop and fills the masks each step."""
