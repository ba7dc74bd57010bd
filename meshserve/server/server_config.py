"""Settings of the HTTP front end (the engine's are EngineConfig's), validated once. Each `flag(...)`
field is also a `meshserve serve` flag with the same default (utils/cli_fields.py)."""
from __future__ import annotations

from dataclasses import dataclass

from meshserve.server.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS
from meshserve.utils.checks import check_range
from meshserve.utils.cli_fields import flag

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_PROMPTS_PER_REQUEST = 4096
MAX_DATA_PARALLEL_SIZE = 64  # engine replicas of one server, or replica servers of one `serve --gateway`
MAX_LEASE_TTL_S = 3600.0


def check_data_parallel_size(size: int) -> None:
    check_range("--data-parallel-size", size, 1, MAX_DATA_PARALLEL_SIZE, integer=True)


@dataclass
class ServerConfig:
    host: str = flag("127.0.0.1", "address to bind (default: %(default)s)")
    port: int = flag(8000, "port to bind (default: %(default)s)")
    api_key: str | None = flag(
        None, "require 'Authorization: Bearer KEY' on every route but /health (default: $MESHSERVE_API_KEY, "
              "else none)", metavar="KEY", env="MESHSERVE_API_KEY")
    metrics_api_key: str | None = flag(
        None, "a second key that opens /metrics only (for a Prometheus scraper; default: "
              "$MESHSERVE_METRICS_API_KEY, else /metrics takes --api-key)", metavar="KEY",
        env="MESHSERVE_METRICS_API_KEY")
    drain_timeout: float = flag(30.0, "on SIGTERM, how long running requests may take to finish (default: "
                                      "%(default)s)", metavar="SECONDS")
    max_queued_requests: int | None = flag(
        None, "at most N sequences (prompts x n) may wait for their first token; more get 429 with Retry-After, "
              "and a request larger than N alone gets 400 (default: unbounded)", type=int, metavar="N")
    max_prompts_per_request: int = flag(64, "prompts one /v1/completions request may batch; more get 400 "
                                            "(default: %(default)s)", metavar="N")
    max_engine_restarts: int = flag(5, "a crashed engine is restarted with backoff; after more than N crashes of "
                                       "one engine within --engine-restart-window the server exits 1 (default: "
                                       "%(default)s)", metavar="N")
    engine_restart_window: float = flag(300.0, "the window --max-engine-restarts counts crashes in (default: "
                                               "%(default)s)", metavar="SECONDS")
    max_body_bytes: int = flag(DEFAULT_MAX_BODY_BYTES, "larger request bodies get 413 (default: %(default)s)",
                               metavar="BYTES")
    data_parallel_size: int = flag(1, "engine replicas behind this server, each with its own KV cache and devices; "
                                      "requests go to the least loaded (default: 1)", aliases=("-dp",), metavar="N")
    max_lease_ttl: float = flag(300.0, "the longest a reservation (POST /v1/reservations) may live unused "
                                       "(default: %(default)s)", metavar="SECONDS")
    max_leases_per_key: int = flag(256, "reservations one API key may hold at once per engine; more get 429 "
                                        "(default: %(default)s)", metavar="N")
    max_stream_backlog: int = flag(1024, "steps of output a request may leave unread (a client that stops "
                                         "reading) before it is aborted (default: %(default)s)", metavar="STEPS")
    health_timeout: float = flag(5.0, "/health answers 503 when no engine's loop answers within this long "
                                      "(a wedged or stopped engine; default: %(default)s)", metavar="SECONDS")
    tool_call_parser: str = flag(DEFAULT_TOOL_PARSER, "how tool calls are read out of answers when tool_choice is "
                                                      "auto (default: %(default)s)", choices=tuple(TOOL_PARSERS))
    log_level: str = flag("info", choices=("debug", "info", "warning", "error"))

    def __post_init__(self) -> None:
        check_range("--port", self.port, 0, 65535, integer=True)
        check_range("--drain-timeout", self.drain_timeout, 0)
        if self.max_queued_requests is not None:
            check_range("--max-queued-requests", self.max_queued_requests, 1, integer=True)
        check_range("--max-prompts-per-request", self.max_prompts_per_request, 1, MAX_PROMPTS_PER_REQUEST,
                    integer=True)
        check_range("--max-engine-restarts", self.max_engine_restarts, 0, integer=True)
        check_range("--engine-restart-window", self.engine_restart_window, 0, lo_open=True)
        check_range("--max-body-bytes", self.max_body_bytes, 1024, integer=True)
        check_data_parallel_size(self.data_parallel_size)
        check_range("--max-lease-ttl", self.max_lease_ttl, 0, MAX_LEASE_TTL_S, lo_open=True)
        check_range("--max-leases-per-key", self.max_leases_per_key, 1, integer=True)
        check_range("--max-stream-backlog", self.max_stream_backlog, 1, integer=True)
        check_range("--health-timeout", self.health_timeout, 0, 600, lo_open=True)
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, "
                             f"not {self.tool_call_parser!r}")
        for name, key in (("--api-key", self.api_key), ("--metrics-api-key", self.metrics_api_key)):
            if key is not None and not key.strip():
                raise ValueError(f"{name} must not be empty")

    def public_dict(self) -> dict[str, object]:
        """For /server_info: everything but the keys themselves."""
        d: dict[str, object] = dict(vars(self))
        d["api_key"] = "set" if self.api_key else None
        d["metrics_api_key"] = "set" if self.metrics_api_key else None
        return d
