"""`meshserve serve [MODEL]`: the OpenAI-compatible HTTP server."""
from __future__ import annotations

import argparse
import os

from meshserve.server.server_config import DEFAULT_MAX_BODY_BYTES, check_data_parallel_size

_EPILOG = """\
examples:
  meshserve serve                                   # embedded default model on 127.0.0.1:8000
  meshserve serve model.gguf --port 8080 --max-model-len 4096 --api-key secret
  meshserve serve --data-parallel-size 2 --gateway   # 2 replica servers + a cache-aware gateway on :8000
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}'
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from meshserve.config import EngineConfig

    p = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /metrics, /server_info). "
        "The engine runs in its own process; SIGTERM drains running requests, then exits 0.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineConfig.add_cli_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send and /v1/models lists (default: the model's id)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="engine replicas behind this server, each with its own KV cache and devices; "
                        "requests go to the least loaded (default: 1)")
    g.add_argument("--api-key", default=os.environ.get("MESHSERVE_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (default: $MESHSERVE_API_KEY, else none)")
    g.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long running requests may take to finish (default: %(default)s)")
    g.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                   help="at most N sequences (prompts x n) may wait for their first token; more get 429 "
                        "with Retry-After, and a request larger than N alone gets 400 (default: unbounded)")
    g.add_argument("--max-prompts-per-request", type=int, default=64, metavar="N",
                   help="prompts one /v1/completions request may batch; more get 400 (default: %(default)s)")
    g.add_argument("--max-engine-restarts", type=int, default=5, metavar="N",
                   help="a crashed engine is restarted with backoff; after more than N crashes of one "
                        "engine within --engine-restart-window the server exits 1 (default: %(default)s)")
    g.add_argument("--engine-restart-window", type=float, default=300.0, metavar="SECONDS",
                   help="the window --max-engine-restarts counts crashes in (default: %(default)s)")
    g.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="BYTES",
                   help="larger request bodies get 413 (default: %(default)s)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_fleet_options(p)
    p.set_defaults(func=run, _parser=p)


# Options of the one-command fleet that its replicas are not started with.
_FLEET_ONLY = {"gateway", "data_parallel_size", "host", "port", "api_key", "policy"}


def add_fleet_options(p: argparse.ArgumentParser) -> None:
    from meshserve.entrypoints.gateway_cli import add_gateway_options
    from meshserve.routing.policies import POLICIES, CacheAwareConfig

    g = p.add_argument_group("fleet (--gateway)")
    g.add_argument("--gateway", action="store_true",
                   help="with --data-parallel-size N: start N replica servers on free loopback ports and a "
                        "gateway on --host/--port in front of them (see `meshserve gateway --help`)")
    g.add_argument("--policy", default="cache_aware", choices=list(POLICIES),
                   help="with --gateway: how the gateway picks a replica (default: %(default)s)")
    before = {a.dest for a in p._actions}
    add_gateway_options(p, CacheAwareConfig(), shared=False)
    _FLEET_ONLY.update(a.dest for a in p._actions if a.dest not in before)


def run(args: argparse.Namespace) -> int:
    if args.gateway:
        return _run_fleet(args)
    from meshserve.config import EngineConfig
    from meshserve.server.launcher import run_server
    from meshserve.server.server_config import ServerConfig

    server_config = ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key, drain_timeout=args.drain_timeout,
        max_queued_requests=args.max_queued_requests, max_body_bytes=args.max_body_bytes,
        max_prompts_per_request=args.max_prompts_per_request, max_engine_restarts=args.max_engine_restarts,
        engine_restart_window=args.engine_restart_window,
        data_parallel_size=args.data_parallel_size, log_level=args.log_level)
    engine_config = EngineConfig.from_cli_args(args).serving_defaults()  # takes served_model_name too
    return run_server(engine_config, server_config)


def _run_fleet(args: argparse.Namespace) -> int:
    import sys

    from meshserve.entrypoints.gateway_cli import config_from_args
    from meshserve.entrypoints.local_fleet import replica_argv, run_fleet

    check_data_parallel_size(args.data_parallel_size)
    argv = sys.argv[sys.argv.index("serve") + 1:] if "serve" in sys.argv else []
    return run_fleet(args, replica_argv(argv, args._parser, _FLEET_ONLY), config_from_args)
