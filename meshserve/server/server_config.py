"""Settings of the HTTP front end (the engine's are EngineConfig's), validated once."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


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
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must be >= 0 seconds, got {self.drain_timeout}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be >= 1, got {self.max_queued_requests}")
        if not 1 <= self.max_prompts_per_request <= 4096:
            raise ValueError(f"--max-prompts-per-request must be in [1, 4096], got {self.max_prompts_per_request}")
        if self.max_engine_restarts < 0:
            raise ValueError(f"--max-engine-restarts must be >= 0, got {self.max_engine_restarts}")
        if self.engine_restart_window <= 0:
            raise ValueError(f"--engine-restart-window must be > 0 seconds, got {self.engine_restart_window}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if not 1 <= self.data_parallel_size <= 64:
            raise ValueError(f"--data-parallel-size must be in [1, 64], got {self.data_parallel_size}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty")

    def public_dict(self) -> dict:
        """For /server_info: everything but the key itself."""
        d = dict(vars(self))
        d["api_key"] = "set" if self.api_key else None
        return d
