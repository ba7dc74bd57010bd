"""Sampler: penalties, temperature, top-k / top-p / min-p and logprobs for a whole batch at once.

Rows with a seed draw from their own generator, so a seeded request samples the same tokens
whatever else shares its batch; other rows share the engine's generator.
Sampling inverts the CDF: one uniform u per row, and the first token whose cumulative probability
exceeds u x the total. That is exact, and it costs one cumulative sum per row, where drawing noise
for the whole vocabulary (the exponential race) costs a random number per vocabulary entry: on a
CPU more than the row's share of the LM head.

On a GPU a step must not wait on the device before its tokens are read: decisions are taken from
the request parameters on the host, per-row parameters and penalty indices travel in one copy
each (host_to_device), and tokens and logprobs come back in one read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from meshserve.layers import cpu_kernels
from meshserve.layers.host_to_device import arrays_to_device, to_device
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
    penalties = to_device([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params],
                          torch.float32, dev)
    rep, freq, pres = (penalties[:, i:i + 1] for i in range(3))
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

    def load(self, histories: dict[int, tuple[list[int], list[int]]], vocab: int) -> None:
        """(Re)build the state of these sequences from (prompt, output) ids, in one host-to-device copy."""
        rows, out_ids, seen_rows, seen_ids = [], [], [], []
        for r, (prompt, output) in enumerate(histories.values()):
            rows += [r] * len(output)
            out_ids += output
            seen_rows += [r] * (len(prompt) + len(output))
            seen_ids += prompt + output
        rows_t, out_t, seen_rows_t, seen_t = arrays_to_device([rows, out_ids, seen_rows, seen_ids], torch.long,
                                                              self.device)
        counts = torch.zeros(len(histories), vocab, device=self.device)
        counts.index_put_((rows_t, out_t), torch.ones(len(out_ids), device=self.device), accumulate=True)
        seen = torch.zeros(len(histories), vocab, dtype=torch.bool, device=self.device)
        seen[seen_rows_t, seen_t] = True
        for r, sid in enumerate(histories):
            self.counts[sid], self.seen[sid] = counts[r], seen[r]

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


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    return cpu_kernels.argmax(logits) if cpu_kernels.usable(logits) and logits.is_contiguous() else logits.argmax(-1)


def takes_argmax(params: list[SamplingParams]) -> bool:
    """Every row's token is the argmax of its logits (after its constraint's mask, if any): greedy,
    no penalties, no logprobs."""
    return all(p.greedy and not p.has_penalties and p.logprobs is None for p in params)


def constrained(allowed: list[bytes | None] | None) -> bool:
    return allowed is not None and any(m is not None for m in allowed)


def _mask(logits: torch.Tensor, allowed: list[bytes | None]) -> torch.Tensor:
    """The logits with every token a constrained row may not take at -inf (other rows untouched)."""
    rows = [r for r, m in enumerate(allowed) if m is not None]
    words = torch.frombuffer(bytearray(b"".join(m for m in allowed if m is not None)), dtype=torch.int32)
    words = words.view(len(rows), -1).to(logits.device)
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=logits.device)) & 1
    keep = bits.view(len(rows), -1)[:, :logits.shape[1]].bool()
    index = to_device(rows, torch.long, logits.device)
    out = logits.clone()
    out[index] = logits[index].masked_fill(~keep, float("-inf"))
    return out


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

    def _uniforms(self, b: int, seq_ids: list[int], params: list[SamplingParams], seed_keys: list[int]):
        u = torch.rand(b, 1, generator=self.generator, device=self.device, dtype=torch.float64)
        for r, (sid, p) in enumerate(zip(seq_ids, params)):
            if p.seed is not None and not p.greedy:
                g = self.seq_generators.get(sid)
                if g is None:
                    g = torch.Generator(device=self.device).manual_seed(seed_keys[r])
                    self.seq_generators[sid] = g
                u[r] = torch.rand(1, generator=g, device=self.device, dtype=torch.float64)
        return u

    def _draw(self, probs: torch.Tensor, seq_ids: list[int], params: list[SamplingParams],
              seed_keys: list[int]) -> torch.Tensor:
        """Per row, the first token whose cumulative probability exceeds u x the row's total: a
        token of probability 0 is never drawn (its cumulative sum equals its predecessor's)."""
        cdf = probs.double().cumsum_(dim=-1)  # in place: no second vocabulary-wide tensor
        u = self._uniforms(probs.shape[0], seq_ids, params, seed_keys)
        picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
        return picked.clamp_(max=probs.shape[1] - 1)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor | None, seq_ids: list[int], params: list[SamplingParams],
                 seed_keys: list[int], histories: list | None = None,
                 allowed: list[bytes | None] | None = None, greedy: torch.Tensor | None = None) -> SamplerOutput:
        """`histories[r]`: (prompt ids, output ids) of a penalized row whose state this sampler does
        not hold yet (None otherwise); later steps need none. `allowed[r]`: the token mask of a
        constrained row (structured outputs), None for the others, which are left as they are.
        `greedy`: the argmax of the logits if already taken (in a CUDA graph, or by the LM head
        without its logits: then `logits` is None), for rows that take_argmax without a constraint."""
        b = len(params)
        want_lp = [p.logprobs for p in params]
        masks = allowed if constrained(allowed) else None
        if takes_argmax(params):
            if masks is not None or greedy is None:  # a constraint's mask comes first
                assert logits is not None, "no argmax taken and no logits to take it from"
                greedy = _argmax(logits if masks is None else _mask(logits, masks))
            return SamplerOutput(greedy.tolist(), [None] * b)  # the argmax of the logits as computed
        assert logits is not None, "sampling, penalties and logprobs need the logits"
        v = logits.shape[1]
        logits = logits.float()
        # Logprobs are the model's own distribution's, before a constraint and the penalties.
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(n is not None for n in want_lp) else None
        if masks is not None:
            logits = _mask(logits, masks)
        penalized = any(p.has_penalties for p in params)
        if penalized:
            new = {sid: h for sid, h in zip(seq_ids, histories or [None] * b) if h is not None}
            if new:
                self.penalties.load(new, v)
            logits = _penalize(logits, params, *self.penalties.batch(seq_ids, v))
        # Decided on the host: no device sync.
        tokens = (_argmax(logits) if all(p.greedy for p in params)
                  else self._sample(logits, seq_ids, params, seed_keys))
        if raw_logprobs is None:
            out = SamplerOutput(tokens.tolist(), [None] * b)  # the step's one device-to-host read
        else:
            out = self._with_logprobs(raw_logprobs, tokens, want_lp)
        if penalized:
            self.penalties.add_sampled(seq_ids, out.token_ids)
        return out

    def _sample(self, logits: torch.Tensor, seq_ids: list[int], params: list[SamplingParams],
                seed_keys: list[int]) -> torch.Tensor:
        """Tokens of a batch where some rows sample; its greedy rows, if any, take the argmax."""
        v = logits.shape[1]
        greedy = _argmax(logits) if any(p.greedy for p in params) else None
        top_k = [p.top_k if p.top_k > 0 else v for p in params]
        # Per row: temperature, greedy, top_k, top_p, min_p (one copy for the whole batch).
        rows = to_device([[1.0 if p.greedy else p.temperature, float(p.greedy), k, p.top_p, p.min_p]
                          for p, k in zip(params, top_k)], torch.float32, self.device)
        filtered = not (all(k >= v for k in top_k) and all(p.top_p >= 1.0 for p in params)
                        and all(p.min_p <= 0 for p in params))
        probs = self._filtered_probs(logits / rows[:, 0:1], rows, filtered)
        sampled = self._draw(probs, seq_ids, params, seed_keys)
        return sampled if greedy is None else torch.where(rows[:, 1] > 0, greedy, sampled)

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
        out: list[tuple[float, list[tuple[int, float]]] | None] = []
        for row, n in zip(table, want):
            if n is None:
                out.append(None)
            else:
                out.append((row[1], [(int(i), lp) for i, lp in zip(row[2 + k:2 + k + n], row[2:2 + n])]))
        return SamplerOutput([int(row[0]) for row in table], out)
