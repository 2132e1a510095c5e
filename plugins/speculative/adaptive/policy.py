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

import math
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
        self.fitted = False  # c is the fit's (else the prior): fitted_cost() was trusted at the last step

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
        self.c, self.fitted = (self.prior_c, False) if c is None else (c, True)

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
        st = self.stats.get(request_id)
        if st is None:
            st = self.stats[request_id] = [0.0, 0.0, 0]
        fail = 1.0 if num_accepted < num_verified else 0.0
        d, total = self.decay, self.total
        st[0] = st[0] * d + num_accepted
        st[1] = st[1] * d + fail
        total[0] = total[0] * d + num_accepted
        total[1] = total[1] * d + fail

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

#: the mode of a step that drafts for every request without having anything verified (a
#: *shadow* step): while the best shape is no drafts, the wrapped proposer sees the requests'
#: text and its drafts are compared with what the target then produces, which keeps the
#: yield a chain would give measured (see :class:`ModeChooser`)
SHADOW = "shadow"


class ModeChooser:
    """Each step's shape (``modes``, the most drafting first: e.g. ``("tree", "chain", "off")``)
    from the measured cost of a step of each shape and the expected tokens it yields.

    Goodput = tokens a step yields / its time. The two parts change at different rates and
    are learnt apart: what a step of each shape *costs* on this engine is a property of the
    engine and the batch, measured per batch-size bucket (``B.bit_length()``) as the median
    of the last ``window`` decode-only step times of that shape (robust to a one-off slow
    step, such as a shape's first); what a step *yields* is the text's: one token per request
    without drafts, ``expected`` per request with a chain, and ``expected`` times the measured
    tree/chain yield ratio with a tree. ``expected`` is measured too (:meth:`chain_yield`): the
    tokens per request of the recent chain steps (:meth:`record`) and, while nothing drafts, of
    shadow steps (:meth:`observe_yield`), so it follows the text while the costs stay put.

    A step's time is recorded only when the step before it ran the same shape (or neither
    drafted): the first step after a switch carries the switch's one-off costs (a proposer
    that sat idle catching up on the tokens it did not see), which a shape run steadily does
    not pay. A bucket measures every shape first (``min_samples`` recorded steps each, the most
    drafting first), then runs the best. The caller's ``min_yield`` (its cost model's least
    yield at which drafts pay at this batch size) gates that: below it no drafting shape is
    measured, as each measurement costs several slow steps (at batch 32, 12 ms against 3.3 ms).
    Among the measured shapes, no drafts must beat the best drafting shape by ``off_margin``
    (default 0: the shapes compete as predicted). A margin of 0.1 for drafting changed nothing
    at batch 8 and read 0.772x plain at batch 32 against 0.825x without it (fresh-process
    invocations). There a chain step costs three undrafted ones, the predicted gains of chains
    are thin, and chains spread a wave's ends over more steps, which the per-step prediction
    does not see (docs/benchmarks/speculative.md, "ninth session").

    A shape not chosen is re-tried after ``retry_every`` steps (in turn), by measuring it anew
    (its old step times dropped, ``min_samples`` + 1 steps; a measurement that records nothing
    in ``2 * window`` steps, e.g. a tree shape whose proposer drafted no tree, ends there);
    not where its predicted goodput is under ``retry_within`` of the best's (no drift of its
    cost seen so far would change the choice: at batch 8 late in a wave chains yield 3-4
    tokens for twice an undrafted step's time, and each re-trial of no drafts cost 5 slow
    steps). Each re-trial that leaves the choice as it was doubles the wait (up to
    ``max_retry_every``); one that changes it brings the wait back. Re-trials only refresh
    what a shape costs; the yield is measured all along. Ties go to the less drafting shape
    (no propose calls to make).

    Where the best is no drafts, the yield is measured every ``shadow_every`` to
    ``max_shadow_every`` steps (:meth:`shadow_wait`: as often as keeps its measured cost under
    ``shadow_budget`` of the undrafted steps' time), by a shadow step (:data:`SHADOW`, recorded
    for no shape) or, where it measured cheaper, a chain step (:meth:`probe`). In a shadow step
    every request drafts, nothing is verified, and the caller compares the drafts with the
    tokens the target then produced (:meth:`observe_yield`). It costs the propose calls of one
    step (the adapter's per-request loop and the proposer's catch-up: 0.5 ms at batch 8, 2 ms at
    batch 32 on code completion) and no verification, and it keeps both the yield and the
    wrapped proposer's view of the text current. Before it (probes of one request, and no
    proposer calls at all while off) a request's text went unseen while speculation was off,
    and the yield estimate kept the early, low acceptance of a wave of requests for up to 256
    steps (docs/benchmarks/speculative.md, "seventh session").

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
        retry_every: int = 64,
        max_retry_every: int = 256,
        yield_decay: float = 0.8,
        shadow_every: int = 4,
        shadow_budget: float = 0.05,
        max_shadow_every: int = 16,
        retry_within: float = 0.75,
        off_margin: float = 0.0,
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
        self.shadow_every, self.shadow_budget = max(1, shadow_every), shadow_budget
        self.max_shadow_every = max(self.shadow_every, max_shadow_every)
        self.retry_within, self.off_margin = retry_within, off_margin
        self.off_since: dict[int, int] = {}  # bucket -> steps off since the last shadow step
        #: bucket -> {mode: the last `window` step times (s)}, and their median (kept as they
        #: change, so choosing a step's mode sorts nothing)
        self.times: dict[int, dict[str, deque[float]]] = {}
        self.medians: dict[int, dict[str, float]] = {}
        #: tokens per request and step, exponentially weighted, of the chain and tree shapes
        self.yields: dict[str, list[float]] = {m: [0.0, 0.0] for m in ("chain", "tree")}
        self.steps = 0  # steps chosen (:meth:`choose`)
        self.yield_step: dict[str, int] = {}  # mode -> the step its yield was last observed at
        #: tokens a tree step gave and tokens its first path (the chain) would have, decayed sums
        #: over the trees verified (:meth:`observe_tree`)
        self.paired = [0.0, 0.0]
        self.paired_decay = yield_decay**0.25  # more slowly than the yields (about 18 trees' memory): trees are few
        self.tries: dict[int, dict[str, int]] = {}  # bucket -> steps chosen to measure a shape
        self.since: dict[int, int] = {}  # bucket -> steps since the last re-trial
        self.turn: dict[int, int] = {}  # bucket -> re-trials begun (which other shape is next)
        self.wait: dict[int, int] = {}  # bucket -> steps between re-trials
        self.best_before: dict[int, str] = {}  # bucket -> the choice when its re-trial began
        self.chosen: dict[str, int] = {m: 0 for m in (*self.modes, SHADOW)}
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
        if mode in ("off", SHADOW):  # a shadow step runs no drafts either: no catch-up after it
            return self.last in ("off", SHADOW)
        return mode == self.last or (mode in _DRAFTING and self.last in _DRAFTING)

    def record(self, batch_size: int, mode: str, seconds: float, tokens: int = 0) -> None:
        """A decode-only step of ``batch_size`` requests ran in ``mode`` for ``seconds`` and
        produced ``tokens`` (requests + accepted drafts; 0: unknown, the yield is not updated).
        A shadow step's time is kept too: what it costs over a step without drafts sets how
        often they come (:meth:`choose`)."""
        steady, self.last = self.timed(mode), mode
        if seconds <= 0 or (mode not in self.modes and mode != SHADOW):
            return
        b = self.bucket(batch_size)
        if b not in self.times:
            self.times[b] = {m: deque(maxlen=self.window) for m in (*self.modes, SHADOW)}
            self.medians[b] = {}
        if steady:
            self.times[b][mode].append(seconds)
            self.medians[b][mode] = median(self.times[b][mode])
        if mode in self.yields and tokens > 0:
            self._add_yield(mode, tokens / max(1, int(batch_size)))

    def _add_yield(self, mode: str, per_request: float) -> None:
        """One step's tokens per request in ``mode``; what was observed before decays by
        ``yield_decay`` per step since (chosen steps, whatever their mode), so a shadow step
        after several steps without drafts outweighs the chain steps before them."""
        y, age = self.yields[mode], max(1, self.steps - self.yield_step.get(mode, self.steps))
        d = self.yield_decay**age
        y[0] = y[0] * d + per_request
        y[1] = y[1] * d + 1.0
        self.yield_step[mode] = self.steps

    def observe_yield(self, per_request: float) -> None:
        """A shadow step's drafts, compared with what the target produced after them: the
        tokens per request a chain step would have yielded (1 + the drafts that matched)."""
        self._add_yield("chain", per_request)

    def chain_yield(self) -> float | None:
        """Tokens per request of a chain step, from the recent chain and shadow steps (None
        before either)."""
        total, weight = self.yields["chain"]
        return total / weight if weight else None

    def forget_text(self) -> None:
        """Drop what was measured of the text (the yields, the tree/chain pairs), keeping what
        was measured of the engine (the step times)."""
        self.yields = {m: [0.0, 0.0] for m in ("chain", "tree")}
        self.yield_step.clear()
        self.paired = [0.0, 0.0]

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

    def probe(self, batch_size: int) -> str:
        """The step that measures the yield while no drafts is best: a shadow step, or a chain
        step where that measured cheaper (at batch 1 a shadow step's catch-up on the tokens its
        proposer did not see costs more than a chain step's drafts: 1.79 against 1.44 ms, with
        1.04 ms undrafted)."""
        med = self.medians.get(self.bucket(batch_size), {})
        chain, shadow = med.get("chain"), med.get(SHADOW)
        return (
            "chain" if "chain" in self.modes and chain is not None and shadow is not None and chain < shadow else SHADOW
        )

    def shadow_wait(self, batch_size: int) -> int:
        """Steps without drafts between the steps that measure the yield (:meth:`probe`):
        ``shadow_every``, or more (up to ``max_shadow_every``) where the probe's measured extra
        time over a step without drafts would exceed ``shadow_budget`` of the steps it watches
        over (a shadow step's propose calls grow with the batch: 2 ms at batch 32 against a
        3.8 ms step)."""
        med = self.medians.get(self.bucket(batch_size), {})
        off, cost = med.get("off"), med.get(self.probe(batch_size))
        if cost is None or not off or cost <= off:
            return self.shadow_every
        wait = math.ceil((cost - off) / (self.shadow_budget * off))
        return min(max(self.shadow_every, wait), self.max_shadow_every)

    def choose(self, batch_size: int, expected: float, min_yield: float = 1.0) -> str:
        """The coming step's mode. ``expected``: tokens per request a chain step would yield
        (:meth:`chain_yield`, or the caller's estimate before any was measured); ``min_yield``:
        the least yield at which the caller's cost model lets a drafting shape pay at this
        batch size (at least 1: no accepted draft never pays)."""
        b = self.bucket(batch_size)
        seen = self.times.get(b)
        self.trying = True
        # below min_yield no drafting shape is measured or re-tried here, each measurement
        # costing several slow steps (shadow steps still watch the yield); a shape measured
        # before is compared by its measured cost
        pays = expected > max(1.0, min_yield)
        candidates = self.modes if pays else ("off",)
        tries = self.tries.setdefault(b, {})
        for m in candidates:  # measure each shape first, the most drafting first
            if (len(seen[m]) if seen else 0) < self.min_samples and tries.get(m, 0) < 2 * self.window:
                tries[m] = tries.get(m, 0) + 1
                return self._chose(m)
        # the measured shapes compete (one whose measurement recorded nothing waits for its next
        # re-trial); where no draft is accepted, none
        candidates = tuple(m for m in (self.modes if expected > 1.0 else ("off",)) if seen and seen[m]) or ("off",)
        # one measured shape (e.g. no step without drafts recorded yet: those that ran had prompt
        # chunks) has nothing to compete with
        goodput = self.predicted(batch_size, expected, candidates) if len(candidates) > 1 else {candidates[0]: 1.0}
        # no drafts must beat the best drafting shape by off_margin (default 0)
        best = max(
            candidates,
            key=lambda m: (goodput[m] * (1.0 + self.off_margin if m != "off" else 1.0), self.modes.index(m)),
        )  # ties: the less drafting
        if b in self.best_before:  # a re-trial just ran: wait longer if it changed nothing
            same = self.best_before.pop(b) == best
            self.wait[b] = (
                min(2 * self.wait.get(b, self.retry_every), self.max_retry_every) if same else self.retry_every
            )
        self.since[b] = self.since.get(b, 0) + 1
        if self.since[b] >= self.wait.get(b, self.retry_every):
            self.since[b] = 0
            self.turn[b] = turn = self.turn.get(b, 0) + 1
            others = [m for m in self.modes if m != best]
            mode = others[turn % len(others)]
            # a shape predicted far behind the best (its goodput under retry_within of it) is not
            # re-tried: no drift in its step time seen so far would change the choice
            near = mode not in goodput or goodput[mode] >= self.retry_within * goodput[best]
            if (pays or mode == "off") and near:
                self.best_before[b] = best
                # measured anew: its old step times go, and the loop above runs it min_samples + 1 steps
                if b in self.times:
                    self.times[b][mode].clear()
                    self.medians[b].pop(mode, None)
                tries[mode] = 0
                return self._chose(mode)
        if best == "off":
            self.off_since[b] = self.off_since.get(b, 0) + 1
            if self.off_since[b] >= self.shadow_wait(batch_size):
                self.off_since[b] = 0
                return self._chose(self.probe(batch_size))
        self.trying = False
        return self._chose(best)

    def _chose(self, mode: str) -> str:
        self.steps += 1
        self.chosen[mode] += 1
        return mode
