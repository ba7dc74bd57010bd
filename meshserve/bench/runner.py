"""Runs a request set against a server under a load pattern and returns the result record."""
from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import aiohttp
import numpy as np

from meshserve.api.middleware import UPSTREAM_KEEP_ALIVE_S
from meshserve.bench import environment
from meshserve.bench.arrivals import arrival_offsets, paced
from meshserve.bench.client import OpenAIStreamClient, RequestRecord
from meshserve.bench.config import BenchConfig, LoadConfig
from meshserve.bench.datasets import BenchRequest, load_requests
from meshserve.bench.metrics import compute_metrics, per_request
from meshserve.bench.tokenization import (
    LocalTokenizer,
    PromptTokenizer,
    ServerTokenizer,
)

if TYPE_CHECKING:
    from tqdm import tqdm

WARMUP_SEED_OFFSET = 1_000_003  # far from the offsets of the timed runs (0, 1, 2, ...)


class ServerUnreachable(RuntimeError):
    pass


class Benchmark:
    """One HTTP session against one server: resolves the model, builds the request set,
    and runs it at any number of load points (a sweep reuses the same set)."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.model_entry: dict | None = None
        self.model = config.model or ""
        self._session: aiohttp.ClientSession | None = None
        self._environment: dict | None = None
        self._tokenizer: PromptTokenizer | None = None

    async def __aenter__(self) -> Benchmark:
        key = self.config.api_key
        # limit=0: aiohttp's default pool of 100 connections would silently cap concurrency; idle
        # connections go before a server with uvicorn's 5 s keep-alive closes them under a request.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEP_ALIVE_S),
            timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_s),
            headers={"Authorization": f"Bearer {key}"} if key else None,
        )
        try:
            await self._resolve_model()
        except BaseException:
            await self._session.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._session is not None
        await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "use `async with Benchmark(...)`"
        return self._session

    async def _resolve_model(self) -> None:
        url = self.config.base_url.rstrip("/") + "/v1/models"
        try:
            async with self.session.get(url) as resp:
                status = resp.status
                body = await resp.json(content_type=None) if status == 200 else {}
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ServerUnreachable(f"cannot reach {url}: {exc}") from exc
        except ValueError:
            status, body = 0, {}
        entries = body.get("data", []) if isinstance(body, dict) else []
        if self.config.model is None:
            if not entries:
                why = f"answered HTTP {status}" if status != 200 else "lists no models"
                raise ServerUnreachable(f"{url} {why}; check --api-key or pass --model NAME")
            self.model = entries[0]["id"]
        self.model_entry = next((e for e in entries if e.get("id") == self.model), None)

    @property
    def max_model_len(self) -> int | None:
        return (self.model_entry or {}).get("max_model_len")

    async def tokenizer(self) -> PromptTokenizer | None:
        """The prompt tokenizer, found once: a sweep asks for one at every point, and a probe
        of the server's /tokenize right after an overloaded point can fail where the first
        one did not."""
        if self._tokenizer is None:
            if self.config.tokenizer:
                self._tokenizer = LocalTokenizer(self.config.tokenizer)
            else:
                tok = ServerTokenizer(self.session, self.config.base_url, self.model)
                try:
                    await tok.encode("hello")
                except (RuntimeError, aiohttp.ClientError, KeyError, ValueError):
                    return None  # the dataset loader says why it needs one, if it does
                self._tokenizer = tok
        return self._tokenizer

    async def load_requests(self, seed_offset: int = 0, count: int | None = None) -> list[BenchRequest]:
        """The dataset's requests; a `seed_offset` draws another set of the same shape, so that a
        second run at another load does not find the first run's prompts in the prefix cache."""
        dataset = self.config.dataset
        if seed_offset or count is not None:
            dataset = dataclasses.replace(dataset, seed=dataset.seed + seed_offset,
                                          num_prompts=count if count is not None else dataset.num_prompts)
        return await load_requests(dataset, await self.tokenizer(), self.max_model_len)

    async def environment(self) -> dict:
        if self._environment is None:
            self._environment = await environment.collect(
                self.session, self.config.base_url, self.model_entry)
        return self._environment

    def client(self) -> OpenAIStreamClient:
        cfg = self.config
        return OpenAIStreamClient(self.session, cfg.base_url, cfg.endpoint, self.model,
                                  ignore_eos=cfg.ignore_eos, temperature=cfg.temperature)

    async def _warm_up(self, client: OpenAIStreamClient, load: LoadConfig) -> None:
        n = self.config.num_warmups
        if n == 0:
            return
        # Prompts of their own: a timed request must not find its prompt cached by the warm-up.
        requests = await self.load_requests(WARMUP_SEED_OFFSET, count=n)
        if not requests:
            return
        gate = asyncio.Semaphore(load.max_concurrency or n)

        async def one(req: BenchRequest) -> RequestRecord:
            async with gate:
                return await client.send(req)

        records = await asyncio.gather(*(one(requests[i % len(requests)]) for i in range(n)))
        if not any(r.success for r in records):
            raise ServerUnreachable(f"every warm-up request failed ({records[0].error}); "
                                    "check --base-url, --endpoint and --model")

    async def run(self, requests: Sequence[BenchRequest], load: LoadConfig | None = None,
                  label: str | None = None) -> dict:
        """Send `requests` at `load` and return the result record (the JSON's contents)."""
        cfg = self.config
        load = load or cfg.load
        client = self.client()
        await self._warm_up(client, load)

        rng = np.random.default_rng([cfg.dataset.seed, 1])  # arrivals: a stream of their own
        offsets = arrival_offsets(len(requests), load.request_rate, load.burstiness, rng)
        gate = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
        progress = _progress(len(requests), cfg.show_progress)

        async def one(req: BenchRequest) -> RequestRecord:
            if gate is None:
                rec = await client.send(req)
            else:
                async with gate:
                    rec = await client.send(req)
            progress.update(1)
            return rec

        start = time.perf_counter()
        tasks = [asyncio.create_task(one(req)) async for req in paced(requests, offsets)]
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        progress.close()

        metrics = compute_metrics(records, duration, cfg.percentile_metrics, cfg.percentiles,
                                  cfg.goodput, cfg.cost_per_replica_hour, cfg.num_replicas)
        return {
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "label": label,
            "base_url": cfg.base_url,
            "endpoint": cfg.endpoint,
            "model_id": self.model,
            "tokenizer": cfg.tokenizer or "server",
            "dataset": dataclasses.asdict(cfg.dataset),
            "request_rate": "inf" if math.isinf(load.request_rate) else load.request_rate,
            "burstiness": load.burstiness,
            "max_concurrency": load.max_concurrency,
            "num_warmups": cfg.num_warmups,
            "ignore_eos": cfg.ignore_eos,
            "temperature": cfg.temperature,
            "percentile_metrics": list(cfg.percentile_metrics),
            "metric_percentiles": list(cfg.percentiles),
            **metrics,
            "environment": await self.environment(),
            "per_request": per_request(records),
        }


def _progress(total: int, enabled: bool) -> tqdm:
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, unit="req", desc="requests", leave=False)


async def _serve(config: BenchConfig, label: str | None) -> dict:
    async with Benchmark(config) as bench:
        return await bench.run(await bench.load_requests(), label=label)


def run_serve(config: BenchConfig, label: str | None = None) -> dict:
    return asyncio.run(_serve(config, label))
