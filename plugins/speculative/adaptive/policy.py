"""Goodput-adaptive draft length after SmartSpec (Liu et al., "Optimizing Speculative
Decoding for Serving Large Language Models Using Goodput", arXiv:2406.14066), pure Python.

Each request's per-token acceptance rate ``a`` is estimated from what the target kept of
its drafts (exponentially decayed counts: a step that accepted ``x`` of ``v`` drafts is ``x``
successes and one failure if ``x < v``), starting from the estimate over all requests. With
``k`` drafts, a step yields ``E(k) = 1 + a + ... + a^k`` tokens in expectation. A step's cost
is modelled as ``c + B * (1 + k)`` token-equivalents (``c`` = ``fixed_cost_tokens``: the
part of a forward pass that does not grow with the tokens in it; ``B`` = batch size, every
request assumed to draft like this one). The chosen length maximises goodput,
``B * E(k) / (c + B * (1 + k))``, over ``k = 0..max_k``; 0 switches speculation off for the
request this step. Small batches (cost dominated by ``c``) speculate; large ones only when
acceptance pays for the extra tokens. A request kept at 0 for ``probe_every`` steps by a low
acceptance estimate drafts one token once, so its estimate can recover.

The cost model is learnt online (SmartSpec profiles it): :meth:`GoodputPolicy.observe_step`
takes each step's wall time and its number of target tokens (requests + drafts verified)
and keeps an exponentially weighted least-squares fit ``time = a + b * tokens``; once the
fit has enough spread in ``tokens`` and a positive slope, ``c = a / b`` replaces
``fixed_cost_tokens`` (the prior). Steps longer than ``max_step_s`` (idle time between
requests) are left out.
"""

from __future__ import annotations

from collections import deque
from statistics import median
from typing import Any


class GoodputPolicy:
    def __init__(
        self,
        max_k: int,
        *,
        fixed_cost_tokens: float,
        prior_acceptance: float,
        prior_weight: float = 2.0,
        decay: float = 0.9,
        probe_every: int = 16,
        learn_cost: bool = True,
        cost_decay: float = 0.99,
        max_step_s: float = 1.0,
        min_cost_samples: int = 16,
    ) -> None:
        if max_k <= 0:
            raise ValueError(f"max_k must be positive, got {max_k}")
        if fixed_cost_tokens < 0:
            raise ValueError(f"fixed_cost_tokens must not be negative, got {fixed_cost_tokens}")
        if not 0.0 <= prior_acceptance < 1.0:
            raise ValueError(f"prior_acceptance must be in [0, 1), got {prior_acceptance}")
        self.max_k, self.c = max_k, fixed_cost_tokens
        self.prior, self.prior_weight, self.decay = prior_acceptance, prior_weight, decay
        self.probe_every = probe_every
        self.stats: dict[str, list[float]] = {}  # request id -> [successes, failures, steps at 0]
        self.total = [0.0, 0.0]  # decayed over all requests
        self.batch_size = 1
        self.chosen: dict[int, int] = {}  # histogram of chosen lengths
        self.prior_c = fixed_cost_tokens
        self.learn_cost, self.cost_decay, self.max_step_s = learn_cost, cost_decay, max_step_s
        self.min_cost_samples = min_cost_samples
        self._fit = [0.0] * 5  # decayed sums: w, x, y, xx, xy
        self.cost_samples = 0

    # ------------------------------------------------------------------ cost model
    def observe_step(self, tokens: int, seconds: float) -> None:
        """One step's target tokens and wall time: refit ``time = a + b * tokens``."""
        if not self.learn_cost or tokens <= 0 or not 0.0 < seconds <= self.max_step_s:
            return
        d, f = self.cost_decay, self._fit
        x, y = float(tokens), float(seconds)
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            f[i] = f[i] * d + v
        self.cost_samples += 1
        c = self.fitted_cost()
        self.c = self.prior_c if c is None else c

    def fitted_cost(self) -> float | None:
        """``a / b`` of the current fit, or None while it is not trustworthy (few samples,
        no spread in tokens, slope not positive)."""
        w, sx, sy, sxx, sxy = self._fit
        if self.cost_samples < self.min_cost_samples or w <= 0:
            return None
        var = sxx / w - (sx / w) ** 2
        if var <= 1e-9 * max(1.0, (sx / w) ** 2):
            return None
        b = (sxy / w - (sx / w) * (sy / w)) / var
        a = sy / w - b * sx / w
        if b <= 0:
            return None
        return min(max(a / b, 0.0), 1e4)

    def begin_step(self, batch_size: int) -> None:
        self.batch_size = max(1, int(batch_size))

    def _estimate(self, s: float, f: float, prior: float) -> float:
        return (s + prior * self.prior_weight) / (s + f + self.prior_weight)

    def acceptance_overall(self) -> float:
        return self._estimate(self.total[0], self.total[1], self.prior)

    def acceptance(self, request_id: str) -> float:
        glob = self._estimate(self.total[0], self.total[1], self.prior)
        st = self.stats.get(request_id)
        return glob if st is None else self._estimate(st[0], st[1], glob)

    def observe(self, request_id: str, num_accepted: int, num_verified: int) -> None:
        if num_verified <= 0:
            return
        st = self.stats.setdefault(request_id, [0.0, 0.0, 0])
        fail = 1.0 if num_accepted < num_verified else 0.0
        for acc in (st, self.total):
            acc[0] = acc[0] * self.decay + num_accepted
            acc[1] = acc[1] * self.decay + fail

    @staticmethod
    def expected_tokens(a: float, k: int) -> float:
        return float(sum(a**i for i in range(k + 1)))

    def goodput(self, a: float, k: int, batch_size: int) -> float:
        b = batch_size
        return b * self.expected_tokens(a, k) / (self.c + b * (1 + k))

    def best_length(self, a: float, batch_size: int) -> int:
        return max(range(self.max_k + 1), key=lambda k: (self.goodput(a, k, batch_size), -k))

    def choose(self, request_id: str) -> int:
        k = self.best_length(self.acceptance(request_id), self.batch_size)
        st = self.stats.setdefault(request_id, [0.0, 0.0, 0])
        if k == 0 and self.best_length(0.99, self.batch_size) > 0:
            # Off because of this request's acceptance (not the batch): probe now and then.
            st[2] += 1
            if st[2] >= self.probe_every:
                st[2], k = 0, 1
        else:
            st[2] = 0
        self.chosen[k] = self.chosen.get(k, 0) + 1
        return k

    def release(self, request_id: str) -> None:
        self.stats.pop(request_id, None)


class ModeBandit:
    """Measured goodput per mode (``modes``: e.g. speculation on and off, or no drafts, a chain
    and a tree), per batch-size bucket (``B.bit_length()``).

    The cost model above can be wrong (on a CPU, verify tokens cost more than the fit says;
    a tree of N nodes costs what this engine makes it cost), so the final say is measured:
    each finished decode-only step gives a sample ``tokens produced / step time`` for the
    mode it ran in; per bucket and mode, the median of the last ``window`` samples (robust to
    a one-off slow step, such as a mode's first, which a mean would carry for long). A bucket tries every
    mode first (``min_samples`` steps each, the preferred one first), then runs the best one,
    re-trying another (in turn) for ``min_samples`` steps after ``explore_every`` steps. Each
    re-trial that leaves the best mode as it was doubles the wait before the next one (up to
    ``max_explore_every``), since every re-trial runs a slower mode; one that changes it
    brings the wait back to ``explore_every``. Ties go to the mode listed first.
    """

    def __init__(
        self,
        modes: tuple = (True, False),
        *,
        window: int = 8,
        min_samples: int = 3,
        explore_every: int = 32,
        max_explore_every: int = 1024,
    ) -> None:
        if len(modes) < 2 or len(set(modes)) != len(modes):
            raise ValueError(f"ModeBandit needs two or more distinct modes, got {modes!r}")
        self.modes = tuple(modes)
        if window < 1:
            raise ValueError(f"window must be positive, got {window}")
        self.window, self.min_samples, self.explore_every = window, min_samples, explore_every
        self.max_explore_every = max(explore_every, max_explore_every)
        # bucket -> {mode: the last `window` samples (tokens/s)}; steps seen per bucket and mode
        self.stats: dict[int, dict[Any, deque[float]]] = {}
        self.samples: dict[int, dict[Any, int]] = {}
        self.since: dict[int, int] = {}
        self.exploring: dict[int, tuple[Any, int]] = {}  # bucket -> (mode re-tried, steps left)
        self.turn: dict[int, int] = {}  # bucket -> re-trials begun (which other mode is next)
        self.wait: dict[int, int] = {}  # bucket -> steps between re-trials
        self.best_before: dict[int, Any] = {}  # bucket -> the best mode when its re-trial began

    @staticmethod
    def bucket(batch_size: int) -> int:
        return max(1, int(batch_size)).bit_length()

    def record(self, batch_size: int, mode: Any, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0 or mode not in self.modes:
            return
        b = self.bucket(batch_size)
        if b not in self.stats:
            self.stats[b] = {m: deque(maxlen=self.window) for m in self.modes}
            self.samples[b] = {m: 0 for m in self.modes}
        self.stats[b][mode].append(tokens / seconds)
        self.samples[b][mode] += 1

    def goodput(self, batch_size: int, mode: Any) -> float | None:
        st = self.stats.get(self.bucket(batch_size), {}).get(mode)
        return median(st) if st else None

    def choose(self, batch_size: int, preferred: Any) -> Any:
        """The coming step's mode (``preferred``: the cost model's view, tried first)."""
        b = self.bucket(batch_size)
        seen = self.samples.get(b)
        for m in (preferred, *(m for m in self.modes if m != preferred)):  # try each mode first
            if (seen[m] if seen else 0) < self.min_samples:
                return m
        best = self._best(b)
        mode, left = self.exploring.get(b, (best, 0))
        if left > 0:
            self.exploring[b] = (mode, left - 1)
            return mode
        if b in self.best_before:  # a re-trial just ended: wait longer if it changed nothing
            same = self.best_before.pop(b) == best
            self.wait[b] = (
                min(2 * self.wait.get(b, self.explore_every), self.max_explore_every) if same else self.explore_every
            )
        self.since[b] = self.since.get(b, 0) + 1
        if self.since[b] >= self.wait.get(b, self.explore_every):
            others = [m for m in self.modes if m != best]
            mode = others[self.turn.get(b, 0) % len(others)]
            self.turn[b] = self.turn.get(b, 0) + 1
            self.since[b] = 0
            self.exploring[b] = (mode, self.min_samples - 1)
            self.best_before[b] = best
            return mode
        return best

    def _best(self, b: int) -> Any:
        st = self.stats[b]
        return max(self.modes, key=lambda m: (median(st[m]), -self.modes.index(m)))
