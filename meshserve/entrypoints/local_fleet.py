"""`meshserve serve --data-parallel-size N --gateway`: N replica servers on free loopback ports and a
gateway in front of them, as one command.

Each replica is an ordinary `meshserve serve` process (data parallel size 1) started with the
engine flags given here; the gateway binds the address the user asked for. SIGINT or SIGTERM ends
the gateway, then every replica (SIGTERM, then SIGKILL to its process group after a grace period),
also when a replica fails to start.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import secrets
import signal
import sys
import tempfile
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

from meshserve.utils.server_process import LaunchedServer, free_port

if TYPE_CHECKING:
    from meshserve.gateway.config import GatewayConfig

logger = logging.getLogger(__name__)

REPLICA_STARTUP_TIMEOUT_S = 600.0


def replica_argv(argv: list[str], parser: argparse.ArgumentParser, dropped: set[str]) -> list[str]:
    """`argv` (the serve command's own arguments) without the options named in `dropped` (and
    their values): what each replica is started with."""
    actions = parser._option_string_actions
    out: list[str] = []
    skip_value = False
    for token in argv:
        if skip_value:
            skip_value = False
            continue
        name = token.split("=", 1)[0]
        action = actions.get(name)
        if action is not None and action.dest in dropped:
            skip_value = "=" not in token and action.nargs != 0
            continue
        out.append(token)
    return out


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def run_fleet(args: argparse.Namespace, argv: list[str],
              gateway_config_from_args: Callable[[argparse.Namespace, list[str], str, int], GatewayConfig]) -> int:
    """Start the replicas, then the gateway (blocking); stop them all on the way out."""
    from meshserve.gateway.app import serve

    n = args.data_parallel_size
    # The gateway's flags are checked before any replica starts (placeholder backends).
    gateway_config_from_args(args, [f"http://127.0.0.1:{i + 1}" for i in range(n)], args.host, args.port)
    log_dir = tempfile.mkdtemp(prefix="meshserve-fleet-")
    # The replicas answer only the gateway: a key of their own, whatever the clients' key is (a client
    # on this host that found a replica's port could otherwise skip the gateway's keys and quotas).
    backend_key = secrets.token_urlsafe(32)
    env = {**os.environ, "MESHSERVE_API_KEY": backend_key}  # not on the command line: `ps` shows that
    cores = os.cpu_count() or 1
    # CPU replicas share the cores instead of each spinning one thread per core.
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // n)))
    ports = [free_port() for _ in range(n)]
    replicas = [LaunchedServer([sys.executable, "-m", "meshserve", "serve", *argv, "--host", "127.0.0.1",
                                "--port", str(port)], os.path.join(log_dir, f"replica-{i}.log"), port=port, env=env)
                for i, port in enumerate(ports)]
    previous = signal.signal(signal.SIGTERM, _raise_exit)  # until uvicorn takes over: stop cleanly
    try:
        for i, replica in enumerate(replicas):
            replica.start()
            print(f"replica {i}: {replica.url} (log {replica.log_path})", file=sys.stderr)
        for replica in replicas:
            replica.wait_healthy_sync(REPLICA_STARTUP_TIMEOUT_S)
        config = dataclasses.replace(gateway_config_from_args(args, [r.url for r in replicas], args.host, args.port),
                                     backend_api_key=backend_key)
        logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
        return asyncio.run(serve(config))
    except RuntimeError as exc:  # a replica exited or never became healthy
        print(f"meshserve serve --gateway: error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        for replica in replicas:
            if replica.proc is not None:
                replica.stop()
