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
        return self._goodput(self.expected_tokens(a, k), k, batch_size)

    def _goodput(self, expected: float, k: int, batch_size: int) -> float:
        """Tokens per unit of step cost with ``k`` drafts that yield ``expected`` tokens a request."""
        b = batch_size
        return b * expected / (self.c + b * (1 + k))

    def best_length(self, a: float, batch_size: int) -> int:
        """The draft length of the highest goodput (ties: the shorter). The expected tokens
        ``1 + a + ... + a^k`` are summed once for every ``k``, in the order and with the terms
        :meth:`expected_tokens` uses, so each goodput is :meth:`goodput`'s to the bit."""
        best, best_g, expected = 0, None, 0.0
        for k in range(self.max_k + 1):
            expected += a**k
            g = self._goodput(expected, k, batch_size)
            if best_g is None or g > best_g:
                best, best_g = k, g
        return best

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


#: the shapes that run the wrapped proposer (a switch between them needs no catch-up)
_DRAFTING = ("chain", "tree")

#: the mode of a step that drafts for a few requests only, to refresh the acceptance estimate
#: while the best shape is no drafts (see :class:`ModeChooser`)
PROBE = "probe"


class ModeChooser:
    """Each step's shape (``modes``, the most drafting first: e.g. ``("tree", "chain", "off")``)
    from the measured cost of a step of each shape and the expected tokens it yields.

    Goodput = tokens a step yields / its time. The two parts change at different rates and
    are learnt apart: what a step of each shape *costs* on this engine is a property of the
    engine and the batch, measured per batch-size bucket (``B.bit_length()``) as the median
    of the last ``window`` decode-only step times of that shape (robust to a one-off slow
    step, such as a shape's first); what a step *yields* is the text's: one token per request
    without drafts, ``expected`` per request with a chain (the acceptance estimate now, from
    :class:`GoodputPolicy`), and ``expected`` times the measured tree/chain yield ratio with a
    tree. So a change in acceptance (a request starts copying its prompt) changes the choice
    at once, without waiting for a re-trial of the shape; a measured tokens-per-second would
    mix the two and keep each shape's value from the text it last ran on.

    A step's time is recorded only when the step before it ran the same shape: the first step
    after a switch carries the switch's one-off costs (a proposer that sat idle catching up
    on the tokens it did not see), which a shape run steadily does not pay. A bucket measures
    every shape first (``min_samples`` recorded steps each, the most drafting first), then runs
    the best; where ``expected`` is 1 (the cost model gives no draft a length at this batch
    size and acceptance) no drafting shape can win, so none is measured and the step runs
    without drafts. A shape not chosen is re-tried after ``retry_every`` steps (in turn), by measuring
    it anew (its old step times dropped, ``min_samples`` + 1 steps; a measurement that records
    nothing in ``2 * window`` steps, e.g. a tree shape whose proposer drafted no tree, ends
    there). Each re-trial that leaves the choice as it was doubles the wait (up to
    ``max_retry_every``); one that changes it brings the wait back. Ties go to the less
    drafting shape (no propose calls to make).

    Where the best is no drafts, of every ``probes_per_measure`` re-trials all but one are
    one-step ``"probe"`` steps (:data:`PROBE`): only a few requests draft (the proposer's
    choice), which refreshes the acceptance estimate (it does not move while nothing drafts) at
    a fraction of a full step's cost; a probe is recorded for no shape. Below
    ``steady_probes_below`` requests there is also a probe every ``probe_every`` steps off,
    which does not back off: at batch 1 an estimate left low by a cold first request kept
    speculation off for 50-250 steps where chains gave 2.5 tokens a step. Measured on code
    completion (docs/benchmarks/speculative.md, "fourth session"): steady probes at every batch
    size read 1.03x plain at batch 8 (0.93x with backed-off probes only) but 0.86x at batch 32
    (0.93x), hence the bound.

    The tree shape: a step is recorded as ``"tree"`` only when it verified a tree with
    branches (the caller says so); a tree-mode step whose proposer drafted only chains is a
    chain step and recorded as one. The first step of a shape after a switch is not timed,
    except between the chain and the tree, which run the same proposer (no catch-up). What a
    tree yields over its chain is measured on the same steps (:meth:`observe_tree`: the tree's
    tokens against those its first path, the chain, would have given), not from tree steps
    against chain steps run on other text.
    """

    def __init__(
        self,
        modes: tuple = ("chain", "off"),
        *,
        window: int = 8,
        min_samples: int = 3,
        retry_every: int = 32,
        max_retry_every: int = 256,
        yield_decay: float = 0.8,
        probes_per_measure: int = 4,
        probe_every: int = 8,
        steady_probes_below: int = 16,
    ) -> None:
        if len(modes) < 2 or len(set(modes)) != len(modes) or "off" not in modes:
            raise ValueError(f"ModeChooser needs two or more distinct modes, 'off' among them; got {modes!r}")
        unknown = set(modes) - {"tree", "chain", "off"}
        if unknown:
            raise ValueError(f"ModeChooser knows the modes tree, chain and off; got {sorted(unknown)}")
        if not 1 <= min_samples <= window:
            raise ValueError(f"need 1 <= min_samples <= window, got min_samples={min_samples}, window={window}")
        self.modes = tuple(modes)
        self.window, self.min_samples = window, min_samples
        self.retry_every = retry_every
        self.max_retry_every = max(retry_every, max_retry_every)
        self.yield_decay = yield_decay
        self.probes_per_measure = max(1, probes_per_measure)
        self.probe_every, self.steady_probes_below = max(1, probe_every), steady_probes_below
        self.off_since: dict[int, int] = {}  # bucket -> steps off since the last steady probe
        #: bucket -> {mode: the last `window` step times (s)}, and their median (kept as they
        #: change, so choosing a step's mode sorts nothing)
        self.times: dict[int, dict[str, deque[float]]] = {}
        self.medians: dict[int, dict[str, float]] = {}
        #: tokens per request and step, exponentially weighted, of the chain and tree shapes
        self.yields: dict[str, list[float]] = {m: [0.0, 0.0] for m in ("chain", "tree")}
        #: tokens a tree step gave and tokens its first path (the chain) would have, decayed sums
        #: over the trees verified (:meth:`observe_tree`)
        self.paired = [0.0, 0.0]
        self.paired_decay = yield_decay**0.25  # more slowly than the yields (about 18 trees' memory): trees are few
        self.tries: dict[int, dict[str, int]] = {}  # bucket -> steps chosen to measure a shape
        self.since: dict[int, int] = {}  # bucket -> steps since the last re-trial
        self.turn: dict[int, int] = {}  # bucket -> re-trials begun (which other shape is next)
        self.wait: dict[int, int] = {}  # bucket -> steps between re-trials
        self.best_before: dict[int, str] = {}  # bucket -> the choice when its re-trial began
        self.chosen: dict[str, int] = {m: 0 for m in (*self.modes, PROBE)}
        self.last: str | None = None  # the mode of the step recorded last
        #: the mode just chosen is a re-trial or a first measurement, not the predicted best (a
        #: drafting re-trial should draft even where the cost model says 0, to refresh acceptance)
        self.trying = False

    @staticmethod
    def bucket(batch_size: int) -> int:
        return max(1, int(batch_size)).bit_length()

    def timed(self, mode: str) -> bool:
        """Whether a step in ``mode`` recorded now has its time kept: the step recorded before it
        ran the same shape, or both ran the wrapped proposer (chain and tree: no catch-up)."""
        return mode == self.last or (mode in _DRAFTING and self.last in _DRAFTING)

    def record(self, batch_size: int, mode: str, seconds: float, tokens: int = 0) -> None:
        """A decode-only step of ``batch_size`` requests ran in ``mode`` for ``seconds`` and
        produced ``tokens`` (requests + accepted drafts; 0: unknown, the yield is not updated)."""
        steady, self.last = self.timed(mode), mode
        if seconds <= 0 or mode not in self.modes:
            return
        b = self.bucket(batch_size)
        if b not in self.times:
            self.times[b] = {m: deque(maxlen=self.window) for m in self.modes}
            self.medians[b] = {}
        if steady:
            self.times[b][mode].append(seconds)
            self.medians[b][mode] = median(self.times[b][mode])
        if mode in self.yields and tokens > 0:
            y = self.yields[mode]
            y[0] = y[0] * self.yield_decay + tokens / max(1, int(batch_size))
            y[1] = y[1] * self.yield_decay + 1.0

    def step_seconds(self, batch_size: int, mode: str) -> float | None:
        return self.medians.get(self.bucket(batch_size), {}).get(mode)

    def observe_tree(self, tree_tokens: int, chain_tokens: int) -> None:
        """One verified tree: the tokens it gave (accepted + 1) and the tokens its first path,
        the chain the same proposer drafts, would have given on the same step."""
        if chain_tokens > 0:
            p, d = self.paired, self.paired_decay
            p[0] = p[0] * d + tree_tokens
            p[1] = p[1] * d + chain_tokens

    def tree_gain(self) -> float:
        """Tokens of a tree step over its chain's: from trees paired with their chains
        (:meth:`observe_tree`) once any was; else tree steps' tokens per request over chain
        steps' (on other text); 1.0 until measured."""
        if self.paired[1]:
            return self.paired[0] / self.paired[1]
        (tc, wc), (tt, wt) = self.yields["chain"], self.yields["tree"]
        return (tt / wt) / (tc / wc) if wc and wt and tc else 1.0

    def predicted(self, batch_size: int, expected: float, modes: tuple | None = None) -> dict[str, float]:
        """Tokens per second of each of ``modes`` (default: all; each measured in this batch
        size's bucket): ``expected`` is a chain step's tokens per request at the current
        acceptance."""
        per_request = {"off": 1.0, "chain": expected, "tree": expected * self.tree_gain()}
        return {
            m: per_request[m] * batch_size / self.step_seconds(batch_size, m)  # type: ignore[operator]
            for m in (modes or self.modes)
        }

    def choose(self, batch_size: int, expected: float) -> str:
        """The coming step's mode. ``expected``: tokens per request a chain step would yield at
        the current acceptance estimate (1 + a + ... + a^k)."""
        b = self.bucket(batch_size)
        seen = self.times.get(b)
        self.trying = True
        # where the acceptance says no draft pays at this batch size (the cost model's k = 0), no
        # drafting shape can win whatever it costs: it is not measured (probes still refresh the
        # acceptance)
        pays = expected > 1.0
        candidates = self.modes if pays else ("off",)
        tries = self.tries.setdefault(b, {})
        for m in candidates:  # measure each shape first, the most drafting first
            if (len(seen[m]) if seen else 0) < self.min_samples and tries.get(m, 0) < 2 * self.window:
                tries[m] = tries.get(m, 0) + 1
                return self._chose(m)
        # a shape whose measurement recorded nothing (see above) waits for its next re-trial
        candidates = tuple(m for m in candidates if seen and seen[m]) or ("off",)
        goodput = self.predicted(batch_size, expected, candidates) if len(candidates) > 1 else {"off": 1.0}
        best = max(candidates, key=lambda m: (goodput[m], self.modes.index(m)))  # ties: the less drafting
        if b in self.best_before:  # a re-trial just ran: wait longer if it changed nothing
            same = self.best_before.pop(b) == best
            self.wait[b] = (
                min(2 * self.wait.get(b, self.retry_every), self.max_retry_every) if same else self.retry_every
            )
        self.since[b] = self.since.get(b, 0) + 1
        if self.since[b] >= self.wait.get(b, self.retry_every):
            self.since[b] = 0
            self.turn[b] = turn = self.turn.get(b, 0) + 1
            self.best_before[b] = best
            others = [m for m in self.modes if m != best]
            mode = others[turn % len(others)]
            if best == "off" and (turn % self.probes_per_measure or not pays):
                return self._chose(PROBE)  # a few requests draft, for their acceptance
            # measured anew: its old step times go, and the loop above runs it min_samples + 1 steps
            if b in self.times:
                self.times[b][mode].clear()
                self.medians[b].pop(mode, None)
            tries[mode] = 0
            return self._chose(mode)
        if best == "off" and batch_size < self.steady_probes_below:
            self.off_since[b] = self.off_since.get(b, 0) + 1
            if self.off_since[b] >= self.probe_every:  # small batch: a probe every probe_every steps
                self.off_since[b] = 0
                return self._chose(PROBE)
        self.trying = False
        return self._chose(best)

    def _chose(self, mode: str) -> str:
        self.chosen[mode] += 1
        return mode
