"""`meshserve gateway --backend URL [--backend URL ...]`: one address in front of many replicas
(`--prefill URL ... --decode URL ...`: pools of a disaggregated fleet, beside or instead of them)."""
from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshserve.gateway.config import GatewayConfig
    from meshserve.routing.policies import CacheAwareConfig

_EPILOG = """\
examples:
  meshserve serve --port 8001 & meshserve serve --port 8002 &
  meshserve gateway --backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002 --port 8000
  meshserve gateway --backend http://10.0.0.5:8000 --policy least_load --tenants tenants.toml \\
                    --trace-file traces.jsonl --resume-streams
  meshserve serve --data-parallel-size 2 --gateway   # the one-command local form
  meshserve serve --kv-role prefill --port 8001 & meshserve serve --kv-role decode --port 8002 &
  meshserve gateway --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002 --disagg-min-tokens 256
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from meshserve.routing.policies import POLICIES, CacheAwareConfig

    d = CacheAwareConfig()
    p = subparsers.add_parser(
        "gateway", help="route one OpenAI-compatible address to many replicas",
        description="A fleet front door: routes requests to replicas (meshserve, or other engines' OpenAI "
        "servers) with cache-aware, least-load or round-robin policies; admits each request only against KV "
        "capacity the chosen replica's engine reserved for it; queues fairly across tenants within their "
        "quotas and deadlines; retries before the first token and reports (or, with --resume-streams, "
        "resumes) streams whose replica fails; exports Prometheus metrics and OpenTelemetry traces.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="a replica's base URL (repeat for each replica); it computes its own prompts")
    p.add_argument("--policy", default="cache_aware", choices=list(POLICIES),
                   help="how a replica is chosen (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    add_gateway_options(p, d)
    s = p.add_argument_group("disaggregated prefill/decode (pools beside or instead of --backend)")
    s.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="a prefill replica (`serve --kv-role prefill`): computes prompts whose KV it hands to a "
                        "decode replica; never gets a client request (repeat for each)")
    s.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a decode replica (`serve --kv-role decode`): takes client requests, their prompt's KV "
                        "from a prefill replica when it pays (repeat for each)")
    s.add_argument("--disagg-min-tokens", type=int, default=256, metavar="N",
                   help="split only when the decode replica lacks more than N of the prompt's tokens (its "
                        "cached prefix as the router expects it); 0: always (default: %(default)s)")
    p.set_defaults(func=run)


def add_gateway_options(p: argparse.ArgumentParser, d: CacheAwareConfig, shared: bool = True) -> None:
    """The gateway's tuning flags (also offered by `meshserve serve --gateway`, which has its own
    --api-key and --log-level: `shared=False` leaves those out)."""
    g = p.add_argument_group("cache_aware cost: max(0, P - c*m) + Q + beta*D over replicas within the slack")
    g.add_argument("--prefix-credit", type=float, default=d.prefix_credit, metavar="C",
                   help="c: prefill tokens saved per cached prompt token (default: %(default)s)")
    g.add_argument("--decode-weight", type=float, default=d.decode_weight, metavar="BETA",
                   help="beta: prefill-token cost of each running sequence (default: %(default)s)")
    g.add_argument("--credit-halving-tokens", type=float, default=d.credit_halving_tokens, metavar="T",
                   help="the credit halves for every T queued tokens over the least-queued replica "
                        "(default: %(default)s)")
    g.add_argument("--slack-requests", type=int, default=d.slack_requests, metavar="N",
                   help="eligible replicas have at most N (or --slack-ratio x) more requests in flight than "
                        "the least loaded (default: %(default)s)")
    g.add_argument("--slack-ratio", type=float, default=d.slack_ratio, metavar="R", help="(default: %(default)s)")
    g.add_argument("--prefix-index-blocks", type=int, default=d.index_blocks, metavar="N",
                   help="blocks the routing prefix index remembers, LRU (default: %(default)s)")
    h = p.add_argument_group("health and failures")
    h.add_argument("--probe-interval", type=float, default=1.0, metavar="S", help="(default: %(default)s)")
    h.add_argument("--probe-timeout", type=float, default=2.0, metavar="S",
                   help="a health probe not answered within this long has failed (default: %(default)s)")
    h.add_argument("--stale-after", type=float, default=5.0, metavar="S",
                   help="load figures older than this make a replica count as saturated (default: %(default)s)")
    h.add_argument("--breaker-failures", type=int, default=3, metavar="N",
                   help="consecutive failures that open a replica's breaker (default: %(default)s)")
    h.add_argument("--breaker-cooldown", type=float, default=1.0, metavar="S",
                   help="open -> half-open; the half-open probe is a health check (default: %(default)s)")
    h.add_argument("--breaker-max-cooldown", type=float, default=30.0, metavar="S",
                   help="the cooldown doubles after each failed half-open probe, up to this (default: %(default)s)")
    h.add_argument("--first-token-timeout", type=float, default=300.0, metavar="S", help="(default: %(default)s)")
    h.add_argument("--retry-budget-ratio", type=float, default=0.1, metavar="R",
                   help="retries allowed per routed request, fleet-wide (default: %(default)s)")
    h.add_argument("--resume-streams", action="store_true",
                   help="continue a greedy or seeded stream on another replica when its replica fails")
    a = p.add_argument_group("admission")
    a.add_argument("--tenants", default=None, metavar="FILE", help="TOML: API keys, concurrency limits, token quotas")
    if shared:
        a.add_argument("--api-key", default=os.environ.get("MESHSERVE_API_KEY"), metavar="KEY",
                       help="without --tenants: require 'Authorization: Bearer KEY' (default: $MESHSERVE_API_KEY)")
    a.add_argument("--backend-api-key", default=os.environ.get("MESHSERVE_BACKEND_API_KEY"), metavar="KEY",
                   help="the replicas' --api-key, sent on every call to them (default: $MESHSERVE_BACKEND_API_KEY)")
    if shared:  # `serve` has these (the same names): a one-command fleet gives them to both
        a.add_argument("--metrics-api-key", default=os.environ.get("MESHSERVE_METRICS_API_KEY"), metavar="KEY",
                       help="a key that opens /metrics only, beside the clients' keys (default: "
                            "$MESHSERVE_METRICS_API_KEY)")
        a.add_argument("--max-prompts-per-request", type=int, default=64, metavar="N",
                       help="prompts one /v1/completions request may batch, checked before anything is "
                            "tokenized; more get 400 (default: %(default)s)")
    a.add_argument("--tokenize-concurrency", type=int, default=8, metavar="N",
                   help="/tokenize calls one request's prompts may have open at once (default: %(default)s)")
    a.add_argument("--max-upstream-connections", type=int, default=512, metavar="N",
                   help="connections to the replicas at once; more requests wait for one (default: %(default)s)")
    a.add_argument("--reservation-timeout", type=float, default=10.0, metavar="S",
                   help="a replica that neither grants nor refuses a reservation within this long has "
                        "failed the call (default: %(default)s)")
    a.add_argument("--skip-ahead-age", type=float, default=5.0, metavar="S",
                   help="a waiting request that does not fit may be passed by later ones that do until it "
                        "has waited this long; then the capacity that frees is kept for it (default: %(default)s)")
    a.add_argument("--lease-ttl", type=float, default=10.0, metavar="S",
                   help="an unused KV reservation ends after this long (default: %(default)s)")
    a.add_argument("--max-queued", type=int, default=1024, metavar="N",
                   help="requests waiting for admission; more get 429 (default: %(default)s)")
    a.add_argument("--max-queue-wait", type=float, default=30.0, metavar="S",
                   help="deadline of a request without X-Request-Deadline-Ms (default: %(default)s)")
    o = p.add_argument_group("observability")
    o.add_argument("--trace-file", default=None, metavar="FILE", help="write OpenTelemetry spans as JSON lines")
    o.add_argument("--otlp-endpoint", default=None, metavar="URL", help="export spans over OTLP/HTTP")
    if shared:
        o.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def config_from_args(args: argparse.Namespace, backends: list[str], host: str, port: int) -> GatewayConfig:
    from meshserve.gateway.config import GatewayConfig
    from meshserve.routing.policies import CacheAwareConfig

    cache_aware = CacheAwareConfig(prefix_credit=args.prefix_credit, decode_weight=args.decode_weight,
                                   credit_halving_tokens=args.credit_halving_tokens,
                                   slack_requests=args.slack_requests, slack_ratio=args.slack_ratio,
                                   index_blocks=args.prefix_index_blocks)
    return GatewayConfig(
        backends=backends, policy=args.policy, host=host, port=port, cache_aware=cache_aware,
        probe_interval_s=args.probe_interval, probe_timeout_s=args.probe_timeout,
        stale_after_s=args.stale_after,
        breaker_failures=args.breaker_failures, breaker_cooldown_s=args.breaker_cooldown,
        breaker_max_cooldown_s=args.breaker_max_cooldown, first_token_timeout_s=args.first_token_timeout,
        retry_budget_ratio=args.retry_budget_ratio, resume_streams=args.resume_streams,
        lease_ttl_s=args.lease_ttl, max_queued=args.max_queued, max_queue_wait_s=args.max_queue_wait,
        tenants_file=args.tenants, api_key=args.api_key if not args.tenants else None,
        backend_api_key=args.backend_api_key, metrics_api_key=args.metrics_api_key,
        max_prompts_per_request=args.max_prompts_per_request, tokenize_concurrency=args.tokenize_concurrency,
        max_upstream_connections=args.max_upstream_connections, reservation_timeout_s=args.reservation_timeout,
        skip_ahead_age_s=args.skip_ahead_age,
        # `serve --gateway` starts colocated replicas only: it has no pools.
        prefill=getattr(args, "prefill", None) or [], decode=getattr(args, "decode", None) or [],
        disagg_min_tokens=getattr(args, "disagg_min_tokens", 256),
        trace_file=args.trace_file, otlp_endpoint=args.otlp_endpoint, log_level=args.log_level)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from meshserve.gateway.app import serve

    config = config_from_args(args, args.backend, args.host, args.port)
    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(config))
