"""Settings of the HTTP front end (the engine's are EngineConfig's), validated once."""
from __future__ import annotations

from dataclasses import dataclass

from meshserve.utils.checks import check_range

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_PROMPTS_PER_REQUEST = 4096
MAX_DATA_PARALLEL_SIZE = 64  # engine replicas of one server, or replica servers of one `serve --gateway`


def check_data_parallel_size(size: int) -> None:
    check_range("--data-parallel-size", size, 1, MAX_DATA_PARALLEL_SIZE, integer=True)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    drain_timeout: float = 30.0           # seconds SIGTERM waits for running requests
    max_queued_requests: int | None = None  # sequences waiting for their first token; beyond: 429
    max_prompts_per_request: int = 64  # prompts in one /v1/completions batch
    max_engine_restarts: int = 5  # crashes of one engine within the window before the server exits
    engine_restart_window: float = 300.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    data_parallel_size: int = 1
    log_level: str = "info"

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
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty")

    def public_dict(self) -> dict:
        """For /server_info: everything but the key itself."""
        d = dict(vars(self))
        d["api_key"] = "set" if self.api_key else None
        return d
