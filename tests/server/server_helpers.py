"""Start servers as subprocesses on free loopback ports, wait until /health answers, stop them."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], *, startup_timeout: float = 180.0, wait: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="meshserve-test-", suffix=".log", delete=False)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)])}
        self.proc = subprocess.Popen([sys.executable, *args, "--port", str(self.port)], cwd=REPO, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready(startup_timeout)

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not become healthy in {timeout} s:\n{self.output()}")

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-5000:]

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        Path(self.log.name).unlink(missing_ok=True)
        return self.proc.returncode


def fake_server(*args: str) -> ServerProcess:
    """A server whose engine process runs server_fake_engine.FakeEngine (starts in about a second)."""
    return ServerProcess(["-c", "import server_fake_engine as f; f.main()", *args], startup_timeout=60)
