"""Benchmark configuration, validated once where it enters (the CLI or a caller)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from meshserve.bench.cost import check_cost_args

DATASETS = ("random", "prefix", "sharegpt", "jsonl")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
METRICS = ("ttft", "tpot", "itl", "e2el")
# Goodput SLOs are per-request conditions; ITL is per gap, so it has no per-request SLO.
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class DatasetConfig:
    name: str = "random"
    path: str | None = None
    # None: 100 for the synthetic sets, every line for jsonl.
    num_prompts: int | None = None
    input_len: int = 512
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 256
    num_prefixes: int = 1
    sharegpt_output_len: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"--dataset-name {self.name!r} is not one of {', '.join(DATASETS)}")
        if self.name in ("sharegpt", "jsonl") and not self.path:
            raise ValueError(f"--dataset-name {self.name} needs --dataset-path")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"--num-prompts {self.num_prompts} must be >= 1")
        if self.input_len < 1:
            raise ValueError(f"--random-input-len {self.input_len} must be >= 1")
        if self.output_len < 1:
            raise ValueError(f"--random-output-len {self.output_len} must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio {self.range_ratio} must be in [0, 1)")
        if self.prefix_len < 1:
            raise ValueError(f"--prefix-len {self.prefix_len} must be >= 1")
        if self.num_prefixes < 1:
            raise ValueError(f"--num-prefixes {self.num_prefixes} must be >= 1")
        if self.sharegpt_output_len is not None and self.sharegpt_output_len < 1:
            raise ValueError(f"--sharegpt-output-len {self.sharegpt_output_len} must be >= 1")

    @property
    def synthetic_count(self) -> int:
        return self.num_prompts if self.num_prompts is not None else 100


@dataclass(frozen=True)
class LoadConfig:
    """How requests arrive: a gamma (Poisson when burstiness is 1) process, capped."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate {self.request_rate} must be > 0 or 'inf'")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"--burstiness {self.burstiness} must be a finite number > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency {self.max_concurrency} must be >= 1")

    def describe(self) -> str:
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g} req/s"
        cap = "" if self.max_concurrency is None else f", max concurrency {self.max_concurrency}"
        return f"rate {rate}, burstiness {self.burstiness:g}{cap}"


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None  # None: the first model the server lists
    tokenizer: str | None = None  # None: the server's /tokenize
    api_key: str | None = field(default=None, repr=False)
    ignore_eos: bool = True
    temperature: float = 0.0
    request_timeout_s: float = 600.0
    num_warmups: int = 1
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    percentile_metrics: tuple[str, ...] = METRICS
    percentiles: tuple[float, ...] = (50.0, 95.0, 99.0)
    goodput: dict[str, float] = field(default_factory=dict)  # metric -> SLO in ms
    show_progress: bool = True
    cost_per_replica_hour: float | None = None  # None: no cost figures
    num_replicas: int = 1  # replicas the price is paid for, e.g. 2 for 1 prefill + 1 decode

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url {self.base_url!r} must start with http:// or https://")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint {self.endpoint!r} is not one of {', '.join(ENDPOINTS)}")
        if self.num_warmups < 0:
            raise ValueError(f"--num-warmups {self.num_warmups} must be >= 0")
        if self.request_timeout_s <= 0:
            raise ValueError(f"--request-timeout {self.request_timeout_s} must be > 0")
        for name in self.percentile_metrics:
            if name not in METRICS:
                raise ValueError(f"--percentile-metrics {name!r} is not one of {', '.join(METRICS)}")
        for p in self.percentiles:
            if not 0 < p <= 100:
                raise ValueError(f"--metric-percentiles {p:g} must be in (0, 100]")
        for name, slo in self.goodput.items():
            if name not in GOODPUT_METRICS:
                raise ValueError(f"--goodput {name!r} is not one of {', '.join(GOODPUT_METRICS)}")
            if not slo > 0:
                raise ValueError(f"--goodput {name}:{slo:g} must be > 0 ms")
        check_cost_args(self.cost_per_replica_hour, self.num_replicas)

    @property
    def chat(self) -> bool:
        return self.endpoint == "/v1/chat/completions"


def parse_rate(text: str) -> float:
    """'inf' or a positive number of requests per second."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"request rate {text!r} must be a number > 0 or 'inf'") from None
    if not value > 0:
        raise ValueError(f"request rate {text!r} must be > 0 or 'inf'")
    return value


def parse_csv_floats(text: str, what: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{what} {text!r} must be comma-separated numbers") from None
    if not values:
        raise ValueError(f"{what} {text!r} is empty")
    return values


def parse_metric_names(text: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [n for n in names if n not in METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics {text!r}: valid names are {', '.join(METRICS)}")
    return names


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:1500', 'tpot:80'] -> {'ttft': 1500.0, 'tpot': 80.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep:
            raise ValueError(f"--goodput {item!r} must look like NAME:MS, e.g. ttft:1500")
        name = name.strip().lower()
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {item!r}: NAME must be one of {', '.join(GOODPUT_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: MS must be a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--goodput {item!r}: MS must be > 0")
        slos[name] = ms
    return slos
