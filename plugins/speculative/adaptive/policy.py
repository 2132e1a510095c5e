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


class GoodputPolicy:
    def __init__(self, max_k: int, *, fixed_cost_tokens: float, prior_acceptance: float,
                 prior_weight: float = 2.0, decay: float = 0.9, probe_every: int = 16,
                 learn_cost: bool = True, cost_decay: float = 0.99, max_step_s: float = 1.0,
                 min_cost_samples: int = 16) -> None:
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

    def acceptance(self, request_id: str) -> float:
        glob = self._estimate(*self.total, self.prior)
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
        return float(sum(a ** i for i in range(k + 1)))

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
