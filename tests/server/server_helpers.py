"""Start servers as subprocesses on free loopback ports, wait until /health answers, stop them."""
from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path

from meshserve.utils.server_process import LaunchedServer, free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


class ServerProcess(LaunchedServer):
    """`python ARGS --port P` with the test helpers importable; started (and by default waited for)
    on construction; its log file is removed by stop()."""

    def __init__(self, args: list[str], *, startup_timeout: float = 180.0, wait: bool = True) -> None:
        log = tempfile.NamedTemporaryFile(prefix="meshserve-test-", suffix=".log", delete=False)
        log.close()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)])}
        port = free_port()
        super().__init__([sys.executable, *args, "--port", str(port)], log.name, port=port, env=env,
                         cwd=str(REPO), grace_s=30.0)
        self.start()
        if wait:
            self.wait_ready(startup_timeout)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        super().wait_ready(timeout_s)

    def output(self) -> str:
        return self.log_tail()

    def terminate(self) -> None:
        self.signal(signal.SIGTERM)

    def stop(self, timeout: float | None = None) -> int:
        code = super().stop(timeout)
        Path(self.log_path).unlink(missing_ok=True)
        return code


def fake_server(*args: str) -> ServerProcess:
    """A server whose engine process runs server_fake_engine.FakeEngine (starts in about a second)."""
    return ServerProcess(["-c", "import sys, server_fake_engine as f; sys.exit(f.main())", *args], startup_timeout=60)
