"""Start a server as a subprocess on a loopback port, wait until /health answers, stop it.

Used by `meshserve bench scaling`, by the benchmarks that start servers, and by the tests. The
server runs in its own process group, so stopping it (SIGTERM to the server, then SIGKILL to the
group after a grace period) also ends whatever processes it started, even if it died first and left
them behind.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from signal import Signals  # in the class, `signal` names its method

import aiohttp


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class LaunchedServer:
    """A server process, started by `start()` (or entering the `with`) and stopped on exit."""

    def __init__(self, argv: list[str], log_path: str, host: str = "127.0.0.1", port: int | None = None,
                 grace_s: float = 20.0, env: Mapping[str, str] | None = None, cwd: str | None = None) -> None:
        self.argv, self.log_path, self.grace_s = list(argv), log_path, grace_s
        self.host, self.port = host, port if port is not None else free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.env, self.cwd = env, cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> LaunchedServer:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env=None if self.env is None else dict(self.env), cwd=self.cwd)
        return self

    def __enter__(self) -> LaunchedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log_tail(self, chars: int = 5000) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def _check_alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            tail = " | ".join(self.log_tail(2000).strip().splitlines()[-5:])
            raise RuntimeError(f"server exited with code {self.proc.returncode} before /health answered "
                               f"(log {self.log_path}: {tail})")

    def _timed_out(self, timeout_s: float) -> RuntimeError:
        return RuntimeError(f"{self.url}/health did not answer 200 within {timeout_s:g} s (log {self.log_path})")

    async def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while time.monotonic() < deadline:
                self._check_alive()
                try:
                    async with session.get(self.url + "/health") as resp:
                        if resp.status == 200:
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.25)
        raise self._timed_out(timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        """wait_healthy_sync, but a server that never gets healthy is stopped and its log tail
        goes into the error (what a test wants to show when start-up fails)."""
        try:
            self.wait_healthy_sync(timeout_s)
        except RuntimeError as exc:
            tail = self.log_tail()
            self.stop()
            raise RuntimeError(f"{exc}\n{tail}") from None

    def wait_healthy_sync(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise self._timed_out(timeout_s)

    def signal(self, sig: Signals) -> None:
        """To the server process only (e.g. SIGTERM to test its own drain)."""
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM to the server (which stops what it started), then SIGKILL to the whole group
        after the grace period; the server's exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.grace_s if grace_s is None else grace_s)
        except subprocess.TimeoutExpired:
            pass
        # Also after a clean exit of the leader: workers it left behind die with the group.
        self._signal_group(signal.SIGKILL)
        return self.proc.wait()

    def _signal_group(self, sig: Signals) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)  # start_new_session made the pid the group id
        except (ProcessLookupError, PermissionError):
            pass
