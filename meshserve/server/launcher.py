"""Start the engine processes, then serve HTTP until SIGTERM/SIGINT; drain; stop the engines."""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
from collections.abc import Callable, Sequence
from typing import Any

from meshserve.distributed.placement import place_for_device
from meshserve.engine.client import EngineClient
from meshserve.engine.core_proc import build_llm_engine
from meshserve.engine.supervisor import SupervisorPolicy
from meshserve.server.metrics import ServerMetrics, register_moe_metrics, register_parallel_metrics
from meshserve.server.server_config import ServerConfig

logger = logging.getLogger("meshserve.server")


def run_server(engine_config: Any, config: ServerConfig,
               factories: Sequence[Callable[[], Any]] | None = None) -> int:
    """Blocking. Returns 0 after a graceful shutdown. `factories` (one per engine) replace the
    default LLMEngine(engine_config) builder, e.g. to serve another engine implementation."""
    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    placements = None
    if factories is None:
        factories = [functools.partial(build_llm_engine, engine_config)] * config.data_parallel_size
        placements = place_for_device(config.data_parallel_size, engine_config.world_size,
                                      engine_config.resolved_device().type)
    client = EngineClient(factories, log_level=config.log_level, placements=placements,
                          policy=SupervisorPolicy(max_restarts=config.max_engine_restarts,
                                                  window_s=config.engine_restart_window),
                          max_stream_backlog=config.max_stream_backlog)
    metrics = ServerMetrics(client.stats)
    register_parallel_metrics(metrics.registry, client.parallel_timing)
    register_moe_metrics(metrics.registry, client.expert_load)
    client.listener = metrics
    info = client.start()
    # For /server_info: the configuration as the engine process holds it (the resolved context
    # length is in its ModelInfo).
    reported = public_config({**info.config, "data_parallel_size": config.data_parallel_size})
    try:
        return asyncio.run(_serve(client, metrics, config, reported))
    finally:
        client.shutdown()


async def _serve(client: EngineClient, metrics: ServerMetrics, config: ServerConfig,
                 engine_config: dict) -> int:
    import uvicorn

    from meshserve.api.middleware import SERVER_KEEP_ALIVE_S
    from meshserve.server.app import build_app
    from meshserve.server.serving import ServingContext

    client.attach(asyncio.get_running_loop())
    ctx = ServingContext(client, config)
    app = build_app(ctx, metrics, engine_config)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level, lifespan="off",
        timeout_keep_alive=SERVER_KEEP_ALIVE_S,
        # uvicorn annotates it int but passes it to asyncio.timeout(), which takes fractional seconds.
        timeout_graceful_shutdown=config.drain_timeout))  # type: ignore[arg-type]
    # uvicorn handles SIGTERM (stop accepting, let running requests finish within the drain timeout)
    # and re-raises it when done; by then the shutdown was orderly, so it must not kill us.
    signal.signal(signal.SIGTERM, lambda *_: None)

    def give_up(reason: str) -> None:  # the supervisor gave up: stop, and say so in the exit code
        server.should_exit = True

    client.on_give_up = give_up
    logger.info("serving %s on http://%s:%d", ctx.model_name, config.host, config.port)
    await server.serve()
    if client.gave_up:
        logger.critical("exiting: the engine keeps crashing")
        return 1
    return 0


def public_config(config: dict) -> dict:
    """The engine configuration as /server_info shows it: JSON values, and local paths by their
    last component only (a server should not publish its file system layout)."""
    def clean(value: object) -> object:
        if isinstance(value, str) and os.path.isabs(value):
            return os.path.basename(value.rstrip(os.sep)) or value
        return value
    public: dict[str, Any] = json.loads(json.dumps({k: clean(v) for k, v in config.items()}, default=str))
    return public

