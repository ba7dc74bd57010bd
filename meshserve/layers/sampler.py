"""Sampler: penalties, temperature, top-k / top-p / min-p and logprobs for a whole batch at once.

Rows with a seed draw their noise from their own generator, so a seeded request samples the same
tokens whatever else shares its batch; other rows share the engine's generator.
Sampling uses the exponential race: argmax(p_i / e_i) with e_i ~ Exp(1) draws i with probability p_i.

On a GPU a step must not wait on the device before its tokens are read: decisions are taken from
the request parameters on the host, per-row parameters and penalty indices travel in one copy
each (host_to_device), and tokens and logprobs come back in one read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from meshserve.layers.host_to_device import arrays_to_device, to_device
from meshserve.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: None, or (sampled token logprob, [(token id, logprob) of the top-N]).
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def _penalize(logits: torch.Tensor, params: list[SamplingParams],
              histories: list[tuple[list[int], list[int]] | None]):
    """Rows without penalties have no history (None) and pass through unchanged."""
    b, v = logits.shape
    dev = logits.device
    out_rows, out_ids, seen_rows, seen_ids = [], [], [], []
    for r, history in enumerate(histories):
        if history is None:
            continue
        prompt, output = history
        out_rows += [r] * len(output)
        out_ids += output
        seen_rows += [r] * (len(prompt) + len(output))
        seen_ids += prompt
        seen_ids += output
    out_rows_t, out_ids_t, seen_rows_t, seen_ids_t = arrays_to_device(
        [out_rows, out_ids, seen_rows, seen_ids], torch.long, dev)
    out_counts = torch.zeros(b, v, device=dev)
    out_counts.index_put_((out_rows_t, out_ids_t), torch.ones(len(out_ids), device=dev), accumulate=True)
    seen = torch.zeros(b, v, dtype=torch.bool, device=dev)
    seen[seen_rows_t, seen_ids_t] = True
    penalties = to_device([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params],
                          torch.float32, dev)
    rep, freq, pres = (penalties[:, i:i + 1] for i in range(3))
    # Repetition penalty (CTRL): seen tokens' positive logits shrink, negative ones grow.
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return logits - freq * out_counts - pres * (out_counts > 0).float()


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.seq_generators: dict[int, torch.Generator] = {}

    def forget(self, seq_ids) -> None:
        for s in seq_ids:
            self.seq_generators.pop(s, None)

    def _noise(self, b: int, v: int, seq_ids: list[int], params: list[SamplingParams], seed_keys: list[int]):
        noise = torch.empty(b, v, device=self.device).exponential_(generator=self.generator)
        for r, (sid, p) in enumerate(zip(seq_ids, params)):
            if p.seed is not None and not p.greedy:
                g = self.seq_generators.get(sid)
                if g is None:
                    g = torch.Generator(device=self.device).manual_seed(seed_keys[r])
                    self.seq_generators[sid] = g
                noise[r].exponential_(generator=g)
        return noise

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seq_ids: list[int], params: list[SamplingParams],
                 seed_keys: list[int], histories: list | None = None) -> SamplerOutput:
        logits = logits.float()
        b, v = logits.shape
        want_lp = [p.logprobs for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(n is not None for n in want_lp) else None
        if histories is not None:
            logits = _penalize(logits, params, histories)
        tokens = logits.argmax(dim=-1)
        if not all(p.greedy for p in params):  # decided on the host: no device sync
            top_k = [p.top_k if p.top_k > 0 else v for p in params]
            # Per row: temperature, greedy, top_k, top_p, min_p (one copy for the whole batch).
            rows = to_device([[1.0 if p.greedy else p.temperature, float(p.greedy), k, p.top_p, p.min_p]
                              for p, k in zip(params, top_k)], torch.float32, self.device)
            filtered = not (all(k >= v for k in top_k) and all(p.top_p >= 1.0 for p in params)
                            and all(p.min_p <= 0 for p in params))
            probs = self._filtered_probs(logits / rows[:, 0:1], rows, filtered)
            sampled = (probs / self._noise(b, v, seq_ids, params, seed_keys)).argmax(dim=-1)
            tokens = torch.where(rows[:, 1] > 0, tokens, sampled)
        if raw_logprobs is None:
            return SamplerOutput(tokens.tolist(), [None] * b)  # the step's one device-to-host read
        return self._with_logprobs(raw_logprobs, tokens, want_lp)

    def _filtered_probs(self, logits: torch.Tensor, rows: torch.Tensor, filtered: bool) -> torch.Tensor:
        """`rows`: the per-row parameters __call__ built; columns 2-4 are top_k, top_p, min_p."""
        if not filtered:
            return torch.softmax(logits, dim=-1)
        v = logits.shape[1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(v, device=self.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= rows[:, 2:3], float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the more likely ones already cover top_p; the first token always stays.
        drop = (probs.cumsum(dim=-1) - probs) > rows[:, 3:4]
        drop |= probs < rows[:, 4:5] * probs[:, :1]
        drop[:, 0] = False
        probs = probs.masked_fill(drop, 0.0)
        return torch.zeros_like(probs).scatter_(1, order, probs / probs.sum(dim=-1, keepdim=True))

    @staticmethod
    def _with_logprobs(raw: torch.Tensor, tokens: torch.Tensor, want: list[int | None]) -> SamplerOutput:
        k = max(n for n in want if n is not None)
        top_vals, top_ids = (raw.topk(k, dim=-1) if k > 0 else (raw[:, :0], raw[:, :0].long()))
        chosen = raw.gather(1, tokens.unsqueeze(1))
        # Tokens, their logprobs and the top k in one float64 table (exact for ids and float32 values):
        # one device-to-host read.
        table = torch.cat([tokens.unsqueeze(1).double(), chosen.double(), top_vals.double(), top_ids.double()],
                          dim=1).tolist()
        out = []
        for row, n in zip(table, want):
            if n is None:
                out.append(None)
            else:
                out.append((row[1], [(int(i), lp) for i, lp in zip(row[2 + k:2 + k + n], row[2:2 + n])]))
        return SamplerOutput([int(row[0]) for row in table], out)
