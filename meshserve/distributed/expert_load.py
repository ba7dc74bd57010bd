"""Tokens routed to each expert of each MoE layer: the skew instruments of expert parallelism.

A learned router decides where tokens go, so the load of an expert, and of the rank holding it, is an
empirical property of the model and the traffic. With expert parallelism every rank waits for the
busiest one at the combine, so one hot rank slows the whole replica while the average looks healthy.

Per MoE layer l (counted once per step on each pipeline stage, by its first TP rank):
    tokens[l][e]     token-expert assignments routed to expert e (a token counts once for each of
                     its k experts)
    rank_load[l][r]  tokens[l][e] summed over the experts EP rank r holds (E / EP consecutive
                     experts; without EP one rank holds all of them)
    max-to-mean      max over r of rank_load[l][r] / mean over r: 1.0 is perfectly balanced, 2.0
                     means the busiest rank does twice its fair share.
Over several layers the ratio is sum_l max_r / sum_l mean_r: every layer waits for its own busiest
rank, so this is the factor by which the expert phase exceeds a perfectly balanced one. The same
definitions at expert granularity (max over experts) show hot experts even on one rank.

`ExpertLoadRecorder` lives in the model of each rank and accumulates one step; `ExpertLoadStats`
lives in the executor and keeps totals since start plus the last step, as a plain snapshot that
travels in the engine stats to the server's metrics and its /moe/expert_load endpoint.
"""
from __future__ import annotations

from typing import Any

import torch


class ExpertLoadRecorder:
    """Per-step counts of one rank's MoE layers, kept on the device (no host sync per layer)."""

    def __init__(self, layers: list[int], num_experts: int) -> None:
        self.layers = list(layers)
        self.num_experts = num_experts
        self._row = {layer: i for i, layer in enumerate(self.layers)}
        self._counts: torch.Tensor | None = None
        # While a decode graph is captured: 1 for the rows of a replay that are real, 0 for its
        # padding, refilled before each replay (None: every row is real).
        self.row_mask: torch.Tensor | None = None

    def add(self, layer: int, counts: torch.Tensor) -> None:
        if self._counts is None:
            self._counts = torch.zeros(len(self.layers), self.num_experts, dtype=torch.long, device=counts.device)
        self._counts[self._row[layer]] += counts

    def add_routed(self, layer: int, ids: torch.Tensor, counts: torch.Tensor) -> None:
        """`counts` of the experts chosen in `ids` [tokens, top_k], less a graph replay's padding."""
        if self.row_mask is not None:
            real = self.row_mask[:, None].expand_as(ids).reshape(-1)
            counts = torch.zeros_like(counts).scatter_add_(0, ids.reshape(-1), real)
        self.add(layer, counts)

    def take(self) -> dict[int, list[int]]:
        """This step's counts by layer, and start a new step."""
        if self._counts is None:
            return {}
        rows = self._counts.cpu().tolist()
        self._counts.zero_()
        return dict(zip(self.layers, rows))


class ExpertLoadStats:
    """One replica's routed tokens, totals since start and the last step, by layer and expert."""

    def __init__(self, num_experts: int, ep_size: int) -> None:
        self.num_experts, self.ep_size = num_experts, ep_size
        self.steps = 0
        self.totals: dict[int, list[int]] = {}
        self.last: dict[int, list[int]] = {}

    def record(self, reports: list[dict[int, list[int]]]) -> None:
        """One step: the reports of the ranks that count (one per pipeline stage)."""
        step: dict[int, list[int]] = {}
        for report in reports:
            step.update(report)
        if not step:
            return
        self.steps += 1
        self.last = step
        for layer, counts in step.items():
            total = self.totals.setdefault(layer, [0] * self.num_experts)
            for e, n in enumerate(counts):
                total[e] += n

    def snapshot(self) -> dict[str, Any]:
        """Plain numbers (this crosses process boundaries inside the engine stats); {} for a dense model."""
        if not self.totals:
            return {}
        layers = sorted(self.totals)
        return {"num_experts": self.num_experts, "ep_size": self.ep_size, "steps": self.steps, "layers": layers,
                "tokens": [list(self.totals[l]) for l in layers],
                "last_step": [list(self.last.get(l, [0] * self.num_experts)) for l in layers]}


# ---- reading a snapshot ----------------------------------------------------------------------
def rank_loads(tokens: list[int], ep_size: int) -> list[int]:
    """Tokens handled by each EP rank: experts are split into ep_size consecutive blocks."""
    per = len(tokens) // ep_size
    return [sum(tokens[r * per:(r + 1) * per]) for r in range(ep_size)]


def max_to_mean(rows: list[list[int]]) -> float:
    """sum over rows of max / sum over rows of mean; 1.0 when there is no load at all."""
    peak = sum(max(r) for r in rows if r)
    mean = sum(sum(r) / len(r) for r in rows if r)
    return peak / mean if mean > 0 else 1.0


def summarize(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The full matrix with per-layer and overall loads and ratios (what /moe/expert_load returns)."""
    if not snapshot:
        return {"moe": False}
    ep, tokens = snapshot["ep_size"], snapshot["tokens"]
    ranks = [rank_loads(row, ep) for row in tokens]
    n = snapshot["num_experts"]
    return {
        "moe": True, "num_experts": n, "ep_size": ep, "experts_per_rank": n // ep, "steps": snapshot["steps"],
        "expert_max_to_mean": max_to_mean(tokens), "rank_max_to_mean": max_to_mean(ranks),
        "expert_tokens": [sum(col) for col in zip(*tokens)], "rank_tokens": [sum(col) for col in zip(*ranks)],
        "layers": [{"layer": layer, "tokens": row, "rank_tokens": rl, "last_step_tokens": last,
                    "expert_max_to_mean": max_to_mean([row]), "rank_max_to_mean": max_to_mean([rl])}
                   for layer, row, rl, last in zip(snapshot["layers"], tokens, ranks, snapshot["last_step"])],
    }


def merge_snapshots(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """Replicas of the same model (data parallelism): tokens add up layer by layer."""
    snapshots = [s for s in snapshots if s]
    if not snapshots:
        return {}
    out = {**snapshots[0], "steps": sum(s["steps"] for s in snapshots)}
    for key in ("tokens", "last_step"):
        out[key] = [[sum(col) for col in zip(*rows)] for rows in zip(*(s[key] for s in snapshots))]
    return out


def format_expert_load_table(snapshot: dict[str, Any]) -> str:
    """Per MoE layer: tokens routed, the hottest expert, and the load of each EP rank."""
    s = summarize(snapshot)
    if not s["moe"]:
        return "no MoE layers"
    ep = s["ep_size"]
    head = ["layer", "tokens", "hot expert", "expert max/mean", *(f"rank {r}" for r in range(ep)), "rank max/mean"]
    rows = []
    for layer in s["layers"]:
        total = sum(layer["tokens"])
        hot = max(range(len(layer["tokens"])), key=layer["tokens"].__getitem__)
        share = layer["tokens"][hot] / total if total else 0.0
        rows.append([str(layer["layer"]), str(total), f"{hot} ({share:.0%})", f"{layer['expert_max_to_mean']:.2f}",
                     *map(str, layer["rank_tokens"]), f"{layer['rank_max_to_mean']:.2f}"])
    rows.append(["all", str(sum(s["expert_tokens"])), "", f"{s['expert_max_to_mean']:.2f}",
                 *map(str, s["rank_tokens"]), f"{s['rank_max_to_mean']:.2f}"])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [f"{s['steps']} steps; {s['num_experts']} experts, EP={ep} ({s['experts_per_rank']} per rank); "
             "tokens = token-expert assignments"]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head, *rows]]
    return "\n".join(lines)


def format_expert_matrix_csv(snapshot: dict[str, Any]) -> str:
    """layer, then one column per expert: the whole matrix, for a spreadsheet or a heat map."""
    n = snapshot["num_experts"]
    lines = ["layer," + ",".join(f"expert_{e}" for e in range(n))]
    lines += [f"{layer}," + ",".join(map(str, row)) for layer, row in zip(snapshot["layers"], snapshot["tokens"])]
    return "\n".join(lines) + "\n"
