"""What a step costs, learned from the engine's own steps: seconds ~ a + b*prompt_tokens +
c*decodes + d*context (context: the tokens the step's rows attend to, as `step_timeline.step_shape` counts them).

The scheduler asks it how many prompt tokens fit beside the running decodes within a time budget.
Steps with prompt tokens and decode-only steps are kept in rings of their own: in steady serving
most steps only decode, and one shared window would soon hold no prompt steps to learn `b` from.
"""
from __future__ import annotations

import sys

import numpy as np

WINDOW = 256          # steps of each kind kept: ~512 in all, the last minute or so of a busy server
MIN_STEPS = 8         # of each kind before the model is trusted
REFIT_EVERY = 16      # observations between fits: a fit is cheap, but not free on every step
FEATURES = ("prompt_tokens", "decodes", "context")
SPIKE_SPREADS = 3.0   # a step this many robust standard deviations above the fit is a spike
TRIM_ROUNDS = 2
MANY_TOKENS = 1 << 30  # beyond any step's token budget: "no limit"


class _Ring:
    def __init__(self, size: int) -> None:
        self.x = np.zeros((size, len(FEATURES) + 1))
        self.y = np.zeros(size)
        self.count = 0

    def add(self, row: list[float], seconds: float) -> None:
        i = self.count % len(self.y)
        self.x[i] = row
        self.y[i] = seconds
        self.count += 1

    @property
    def filled(self) -> int:
        return min(self.count, len(self.y))


class StepCostModel:
    def __init__(self, window: int = WINDOW, min_steps: int = MIN_STEPS, refit_every: int = REFIT_EVERY) -> None:
        self._prompt_steps = _Ring(window)
        self._decode_steps = _Ring(window)
        self.min_steps = min_steps
        self.refit_every = refit_every
        self._since_fit = 0
        self._coef: np.ndarray | None = None  # a, b, c, d

    def observe(self, shape: dict[str, int], seconds: float) -> None:
        prompt, decodes, context = (shape.get(k, 0) for k in FEATURES)
        if prompt <= 0 and decodes <= 0:
            return
        ring = self._prompt_steps if prompt > 0 else self._decode_steps
        ring.add([1.0, prompt, decodes, context], seconds)
        self._since_fit += 1

    @property
    def ready(self) -> bool:
        """Enough of both kinds of step seen that `b` (prompt) and `c`, `d` (decode) are pinned down."""
        return self._prompt_steps.filled >= self.min_steps and self._decode_steps.filled >= self.min_steps

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        """(a, b, c, d), each >= 0; zeros until `ready`."""
        if not self.ready:
            return (0.0, 0.0, 0.0, 0.0)
        if self._coef is None or self._since_fit >= self.refit_every:
            self._coef = self._fit()
            self._since_fit = 0
        a, b, c, d = (float(v) for v in self._coef)
        return a, b, c, d

    def _fit(self) -> np.ndarray:
        rings = (self._prompt_steps, self._decode_steps)
        x = np.concatenate([r.x[:r.filled] for r in rings])
        y = np.concatenate([r.y[:r.filled] for r in rings])
        # Columns scaled to one magnitude: context runs to 1e5 where decodes stay near 1e1.
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        xs = x / scale
        coef = _nonnegative_lstsq(xs, y)
        # Another process, a page fault or a first-seen shape only ever slows a step: such spikes
        # (far above the fit, by the residuals' median spread) are left out of the final fit.
        for _ in range(TRIM_ROUNDS):
            residual = y - xs @ coef
            spread = 1.4826 * float(np.median(np.abs(residual - np.median(residual))))
            keep = residual <= SPIKE_SPREADS * spread
            if spread <= 0 or keep.all():
                break
            xs, y = xs[keep], y[keep]
            coef = _nonnegative_lstsq(xs, y)
        fitted: np.ndarray = coef / scale
        return fitted

    def predict(self, prompt_tokens: int, decodes: int, context: int) -> float:
        a, b, c, d = self.coefficients
        return a + b * prompt_tokens + c * decodes + d * context

    def prompt_tokens_within(self, budget_s: float, decodes: int, context: int) -> int:
        """The most prompt tokens a step beside `decodes` decodes (attending to `context` tokens) may
        take and still be predicted to fit `budget_s`; each prompt token adds to the context too.
        0 when not even the decodes fit; sys.maxsize when the budget is no limit at all."""
        _, b, _, d = self.coefficients
        spare = budget_s - self.predict(0, decodes, context)
        if spare < 0:
            return 0
        per_token = b + d
        if per_token <= 0 or spare / per_token >= MANY_TOKENS:
            return sys.maxsize
        n = int(spare / per_token)
        # The division may round across a whole token either way: one step settles it.
        if n > 0 and self.predict(n, decodes, context + n) > budget_s:
            n -= 1
        elif self.predict(n + 1, decodes, context + n + 1) <= budget_s:
            n += 1
        return n


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: a negative cost would promise free tokens. A
    coefficient fitted below zero is dropped and the rest refitted (an active-set fit that ends
    within one round per feature)."""
    active = np.ones(x.shape[1], dtype=bool)
    coef = np.zeros(x.shape[1])
    for _ in range(x.shape[1]):
        coef[:] = 0.0
        coef[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        if (coef >= 0).all():
            break
        active &= coef > 0
        if not active.any():
            break
    return np.maximum(coef, 0.0)
