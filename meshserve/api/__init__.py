"""The OpenAI wire format shared by the replica server, the gateway and the benchmark: request
models, error bodies and SSE framing. Nothing here starts or imports an engine."""
