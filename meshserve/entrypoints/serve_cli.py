"""`meshserve serve [MODEL]`: the OpenAI-compatible HTTP server."""
from __future__ import annotations

import argparse

from meshserve.server.server_config import ServerConfig, check_data_parallel_size
from meshserve.utils.cli_fields import add_flags, values_for

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
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send and /v1/models lists (default: the model's id)")
    add_flags(g, ServerConfig)
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

    server_config = ServerConfig(**values_for(ServerConfig, args))
    engine_config = EngineConfig.from_cli_args(args).serving_defaults()  # takes served_model_name too
    return run_server(engine_config, server_config)


def _run_fleet(args: argparse.Namespace) -> int:
    import sys

    from meshserve.entrypoints.gateway_cli import config_from_args
    from meshserve.entrypoints.local_fleet import replica_argv, run_fleet

    check_data_parallel_size(args.data_parallel_size)
    argv = sys.argv[sys.argv.index("serve") + 1:] if "serve" in sys.argv else []
    return run_fleet(args, replica_argv(argv, args._parser, _FLEET_ONLY), config_from_args)
