"""Sampler: penalties, temperature, top-k / top-p / min-p and logprobs for a whole batch at once.

Rows with a seed draw their noise from their own generator, so a seeded request samples the same
tokens whatever else shares its batch; other rows share the engine's generator.
Sampling uses the exponential race: argmax(p_i / e_i) with e_i ~ Exp(1) draws i with probability p_i.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from meshserve.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: None, or (sampled token logprob, [(token id, logprob) of the top-N]).
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def _penalize(logits: torch.Tensor, params: list[SamplingParams], counts: torch.Tensor,
              seen: torch.Tensor) -> torch.Tensor:
    """`counts[r, t]`: how often row r generated token t; `seen[r, t]`: t is in its prompt or output.
    Rows without penalties (repetition 1, frequency and presence 0) come out unchanged."""
    dev = logits.device
    rep = torch.tensor([p.repetition_penalty for p in params], device=dev).unsqueeze(1)
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params], device=dev).unsqueeze(1)
    # Repetition penalty (CTRL): seen tokens' positive logits shrink, negative ones grow.
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return logits - freq * counts - pres * (counts > 0).float()


class PenaltyState:
    """Per penalized sequence, on the sampling rank: output-token counts and the tokens seen (prompt
    and output). Built once from the history the engine sends, then kept up to date with each token
    sampled here, so no step has to ship a sequence's whole history again."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counts: dict[int, torch.Tensor] = {}
        self.seen: dict[int, torch.Tensor] = {}

    def load(self, seq_id: int, vocab: int, prompt: list[int], output: list[int]) -> None:
        dev = self.device
        counts = torch.zeros(vocab, device=dev)
        if output:
            counts.index_add_(0, torch.tensor(output, device=dev), torch.ones(len(output), device=dev))
        seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
        seen[torch.tensor(prompt + output, dtype=torch.long, device=dev)] = True
        self.counts[seq_id], self.seen[seq_id] = counts, seen

    def batch(self, seq_ids: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        counts = torch.zeros(len(seq_ids), vocab, device=self.device)
        seen = torch.zeros(len(seq_ids), vocab, dtype=torch.bool, device=self.device)
        for r, sid in enumerate(seq_ids):
            if sid in self.counts:
                counts[r], seen[r] = self.counts[sid], self.seen[sid]
        return counts, seen

    def add_sampled(self, seq_ids: list[int], tokens: list[int]) -> None:
        for sid, tok in zip(seq_ids, tokens):
            if sid in self.counts:
                self.counts[sid][tok] += 1
                self.seen[sid][tok] = True

    def forget(self, seq_ids) -> None:
        for s in seq_ids:
            self.counts.pop(s, None)
            self.seen.pop(s, None)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.seq_generators: dict[int, torch.Generator] = {}
        self.penalties = PenaltyState(self.device)

    def forget(self, seq_ids) -> None:
        for s in seq_ids:
            self.seq_generators.pop(s, None)
        self.penalties.forget(seq_ids)

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
        """`histories[r]`: (prompt ids, output ids) of a penalized row whose state this sampler does
        not hold yet (None otherwise); later steps need none."""
        logits = logits.float()
        b, v = logits.shape
        want_lp = [p.logprobs for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(n is not None for n in want_lp) else None
        penalized = [sid for sid, p in zip(seq_ids, params) if p.has_penalties]
        if penalized:
            for sid, history in zip(seq_ids, histories or [None] * b):
                if history is not None:
                    self.penalties.load(sid, v, *history)
            logits = _penalize(logits, params, *self.penalties.batch(seq_ids, v))
        greedy_rows = torch.tensor([p.greedy for p in params], device=self.device)
        tokens = logits.argmax(dim=-1)
        if not bool(greedy_rows.all()):
            temp = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=self.device)
            probs = self._filtered_probs(logits / temp.unsqueeze(1), params)
            sampled = (probs / self._noise(b, v, seq_ids, params, seed_keys)).argmax(dim=-1)
            tokens = torch.where(greedy_rows, tokens, sampled)
        token_list = tokens.tolist()
        if penalized:
            self.penalties.add_sampled(seq_ids, token_list)
        return SamplerOutput(token_list, self._logprobs(raw_logprobs, token_list, want_lp))

    def _filtered_probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        v = logits.shape[1]
        top_k = [p.top_k if p.top_k > 0 else v for p in params]
        if all(k >= v for k in top_k) and all(p.top_p >= 1.0 for p in params) and all(p.min_p <= 0 for p in params):
            return torch.softmax(logits, dim=-1)
        dev = self.device
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(v, device=dev).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= torch.tensor(top_k, device=dev).unsqueeze(1), float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        top_p = torch.tensor([p.top_p for p in params], device=dev).unsqueeze(1)
        # Drop a token when the more likely ones already cover top_p; the first token always stays.
        drop = (probs.cumsum(dim=-1) - probs) > top_p
        min_p = torch.tensor([p.min_p for p in params], device=dev).unsqueeze(1)
        drop |= probs < min_p * probs[:, :1]
        drop[:, 0] = False
        probs = probs.masked_fill(drop, 0.0)
        return torch.zeros_like(probs).scatter_(1, order, probs / probs.sum(dim=-1, keepdim=True))

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, tokens: list[int], want: list[int | None]):
        if raw is None:
            return [None] * len(tokens)
        k = max(n for n in want if n is not None)
        top_vals, top_ids = (raw.topk(k, dim=-1) if k > 0 else (raw[:, :0], raw[:, :0].long()))
        chosen = raw.gather(1, torch.tensor(tokens, device=raw.device).unsqueeze(1)).squeeze(1).tolist()
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        out = []
        for r, n in enumerate(want):
            out.append(None if n is None else (chosen[r], list(zip(top_ids[r][:n], top_vals[r][:n]))))
        return out
