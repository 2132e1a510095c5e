"""Adaptive proposer: wraps another registered proposer, sets its draft length per request
and step (see ``policy``), and picks each step's shape by measured goodput: no drafts, a chain,
or (when the wrapped proposer drafts trees) a tree."""

from __future__ import annotations

import time
from typing import Any, Sequence

from ....hooks import Kind, Proposer, SelfSpeculativeProposer

from .policy import SHADOW, GoodputPolicy, ModeChooser


def build_inner(params: Any) -> Proposer:
    """The wrapped proposer, built from the registry as the runtime builds plugins."""
    from ....hooks.manager import get_registry

    entry = get_registry().get(Kind.SPECULATIVE, params.proposer)
    cls = entry.registration.load()
    if not (isinstance(cls, type) and issubclass(cls, Proposer)):
        raise TypeError(f"adaptive: {params.proposer!r} does not implement Proposer")
    return cls(params.inner_params())


class Adaptive(Proposer):
    def __init__(self, params: Any, inner: Proposer | None = None) -> None:
        super().__init__(params)
        self.inner = inner if inner is not None else build_inner(params)
        self.topk = int(getattr(self.inner, "topk", 0) or 0)  # forwarded
        self.per_request_drafts = bool(getattr(self.inner, "per_request_drafts", False))  # forwarded
        self.needs_target_weights = bool(getattr(self.inner, "needs_target_weights", False))  # forwarded
        self.drafts_trees = bool(getattr(self.inner, "drafts_trees", False))  # forwarded: trees are a mode
        #: the longest chain (the policy's longest draft): with a tree proposer, whose
        #: num_speculative_tokens counts tree nodes, ``chain_tokens`` or its ``tree_depth``
        self.chain_max = int(params.num_speculative_tokens)
        if self.drafts_trees:
            self.chain_max = int(
                params.chain_tokens or getattr(self.inner.params, "tree_depth", 0) or params.num_speculative_tokens
            )
        #: the shapes a step may take, the most drafting first (ties in measured goodput go to it)
        self.modes: tuple[str, ...] = ("tree", "chain", "off") if self.drafts_trees else ("chain", "off")
        self.policy = self._new_policy()
        self._last_step: float | None = None  # when the previous step's drafting began
        self._step_tokens = 0  # estimate of the tokens the next step computes (no num_tokens)
        self.bandit = ModeChooser(self.modes, shadow_every=params.shadow_every) if params.measure_goodput else None
        self._mode = self.modes[0]  # this step's mode (the bandit's choice)
        self._prev: tuple[int, str] | None = None  # (batch size, mode) of the previous step
        self._produced = self._verified = self._requests = 0  # of the step just run
        self._prev_tokens = 0  # num_tokens given to the previous begin_step
        self._prev_seconds = 0.0  # the time of the step before the previous begin_step
        #: each request's draft length from the SmartSpec cost model (``per_request_length``, or
        #: without measured goodput); else the longest, as the wrapped proposer drafts on its own
        self.per_request = bool(params.per_request_length) or not params.measure_goodput
        #: request id -> (its token count, the drafts, the length a chain step would have given it)
        #: of its last shadow step (:data:`.policy.SHADOW`), until compared with what followed
        self._shadows: dict[str, tuple[int, list[int], int]] = {}
        self._shadow_yield = [0.0, 0]  # the current step's compared shadows: tokens, requests
        self._real_tree = False  # this step's drafting gave some request a tree with branches
        #: request id -> [its token count when drafted, its tree's first path (the chain), tokens
        #: accepted (None until verified)]: the tree paired with its chain (:meth:`_pair`)
        self._trees: dict[str, list] = {}

    def _new_policy(self) -> GoodputPolicy:
        p = self.params
        return GoodputPolicy(
            self.chain_max,
            fixed_cost_tokens=p.fixed_cost_tokens,
            prior_acceptance=p.prior_acceptance,
            decay=p.decay,
            probe_every=p.probe_every,
            learn_cost=p.learn_cost,
        )

    def fresh_drafting_state(self) -> None:
        """The wrapped proposer's drafting state and the acceptance statistics are renewed;
        what was measured of the engine is kept (the step-cost fit and the goodput of
        speculation on and off per batch size): it says nothing of earlier outputs, and a
        deployment keeps it for its whole life, so a timed run starts as a serving engine
        would, not from the prior."""
        self.inner.fresh_drafting_state()
        policy, fresh = self.policy, self._new_policy()
        fresh.c, fresh._fit, fresh.cost_samples, fresh.fitted = (
            policy.c,
            policy._fit,
            policy.cost_samples,
            policy.fitted,
        )
        self.policy = fresh
        self._last_step, self._prev, self._step_tokens = None, None, 0
        self._trees.clear()
        self._shadows.clear()
        self._shadow_yield = [0.0, 0]
        if self.bandit is not None:
            self.bandit.forget_text()
        self._produced = self._verified = self._requests = 0

    @property
    def _on(self) -> bool:
        """This step drafts (a chain or a tree)."""
        return self._mode != "off"

    def begin_step(self, num_requests: int, num_tokens: int = 0) -> bool:
        # The time since the previous step's drafting is one engine step: the forward pass
        # of the step just run (``num_tokens``: prompt chunks, decodes, verified drafts), plus
        # scheduling, sampling and drafting.
        now = time.perf_counter()
        if self._last_step is not None:
            seconds = now - self._last_step
            self.policy.observe_step(num_tokens or self._step_tokens, seconds)
            # The step that ended at the previous begin_step: its time and the tokens it produced
            # (requests + accepted drafts, reported during that step's drafting), in the mode
            # chosen before it; steps with prompt chunks are left out.
            if (
                self.bandit is not None
                and self._prev is not None
                and self._prev_tokens
                and self._prev_tokens <= self._requests + self._verified
                and seconds <= self.policy.max_step_s
            ):
                self.bandit.record(self._prev[0], self._prev[1], self._prev_seconds, self._produced)
            self._prev_seconds = seconds
        else:
            self._prev_seconds = 0.0
        self._prev_tokens = num_tokens
        # a tree-mode step that verified no tree with branches ran chains: it is a chain step
        mode = "chain" if self._mode == "tree" and not self._real_tree else self._mode
        self._prev, self._real_tree = (self.policy.batch_size, mode), False
        self._produced = self._requests = num_requests
        self._verified = 0
        self._last_step, self._step_tokens = now, num_requests
        self.policy.begin_step(num_requests)
        if self.bandit is not None:
            if self._shadow_yield[1]:
                self.bandit.observe_yield(self._shadow_yield[0] / self._shadow_yield[1])
                self._shadow_yield = [0.0, 0]
            self._mode = self.bandit.choose(num_requests, self._expected(num_requests), self._min_yield(num_requests))
        self.inner.begin_step(num_requests, num_tokens)
        # off: no request drafts this step, so the adapter asks no propose (Proposer.begin_step)
        return self._on

    def observe_topk(self, request_id: str, tokens: Sequence[int], topk_ids: Any) -> None:
        self.inner.observe_topk(request_id, tokens, topk_ids)

    def attach_target(self, weights: Any) -> None:
        """The target model, for a wrapped self-speculative proposer (``swift``)."""
        if not isinstance(self.inner, SelfSpeculativeProposer):
            raise TypeError(
                f"adaptive: the wrapped proposer {type(self.inner).__name__} drafts without "
                "the target's weights (needs_target_weights is False)"
            )
        self.inner.attach_target(weights)

    def accepted(self, request_id: str, num_accepted: int, num_verified: int) -> None:
        if self._trees:
            tree = self._trees.get(request_id)
            if tree is not None and tree[2] is None:
                tree[2] = num_accepted
        self._produced += num_accepted
        self._verified += num_verified
        self.policy.observe(request_id, num_accepted, num_verified)
        self.inner.accepted(request_id, num_accepted, num_verified)

    def _expected(self, num_requests: int) -> float:
        """Tokens per request a chain step would yield: measured (chain and shadow steps), else
        the cost model's estimate at the acceptance so far."""
        measured = self.bandit.chain_yield() if self.bandit is not None else None
        if measured is not None:
            return measured
        a = self.policy.acceptance_overall()
        return self.policy.expected_tokens(a, self.policy.best_length(a, num_requests))

    def _min_yield(self, num_requests: int) -> float:
        """The least chain yield (tokens per request) at which the step cost model
        (``c + tokens``, ``c`` fitted from step times) lets full chains pay at this batch size:
        a drafting shape not measured here is not tried below it. 1 while the fit is not
        trusted: a prior ``c`` far below the engine's would otherwise keep chains from ever
        being measured, and so the fit from ever getting the spread in tokens it needs."""
        if not self.policy.fitted:
            return 1.0
        c, b = self.policy.c, max(1, num_requests)
        return (c + b * (1 + self.chain_max)) / (c + b)

    def _length(self, request_id: str, most: int) -> int:
        """This request's draft length this step (0: none): the longest, or with per-request
        lengths the cost model's, at least 1 on a step that re-tries or first measures a
        drafting shape (so acceptance is refreshed)."""
        if not self._on:
            return 0
        if not self.per_request:
            return min(most, self.chain_max)
        k = self.policy.choose(request_id)
        if k == 0 and self.bandit is not None and self.bandit.trying:
            k = 1
        return min(most, k)

    def _shadow(self, request_id: str, token_ids: Sequence[int], most: int) -> None:
        """A shadow step's drafts for the request, kept to compare with what follows (an earlier
        shadow still waiting for its tokens is kept instead); the wrapped proposer sees the text
        as on any drafting step."""
        k = min(most, self.chain_max)
        drafts = list(self.inner.propose(request_id, token_ids, k))[:k]
        if request_id in self._shadows:
            return
        if self.per_request:
            k = min(k, self.policy.best_length(self.policy.acceptance(request_id), self.policy.batch_size))
        self._shadows[request_id] = (len(token_ids), drafts, k)

    def _compare(self, request_id: str, token_ids: Sequence[int]) -> None:
        """The request's last shadow drafts against the tokens the target produced after them:
        the tokens a chain would have yielded (1 + the drafts that matched, up to its length).
        Kept while too few tokens have followed to tell. Exact under greedy decoding; under
        sampling a draft unlike the sampled token might still have passed rejection sampling,
        so there it reads the yield low."""
        start, drafts, k = self._shadows[request_id]
        new = token_ids[start : start + len(drafts)]
        matched = 0
        while matched < len(new) and new[matched] == drafts[matched]:
            matched += 1
        if matched == len(new) < len(drafts):
            return  # not yet known how far the drafts would have held
        del self._shadows[request_id]
        if drafts:
            self.policy.observe(request_id, matched, len(drafts))
        self._shadow_yield[0] += 1 + min(matched, k)
        self._shadow_yield[1] += 1

    def _pair(self, request_id: str, token_ids: Sequence[int]) -> None:
        """The request's last tree, verified since: what it gave against what its first path
        (the chain the wrapped proposer drafts: lookahead and token-recycling put it first)
        would have given, read from the tokens the step appended (accepted + 1: greedy, the
        target's own tokens, which the chain would have been checked against)."""
        tree = self._trees.pop(request_id, None)
        if tree is None or tree[2] is None or self.bandit is None:
            return
        start, chain, accepted = tree
        new = token_ids[start : start + accepted + 1]
        kept = 0
        while kept < min(len(chain), len(new), accepted) and chain[kept] == new[kept]:
            kept += 1
        self.bandit.observe_tree(accepted + 1, kept + 1)

    def _settle(self, request_id: str, token_ids: Sequence[int], most: int) -> bool:
        """Before a request drafts: score its last tree and its last shadow drafts against the
        tokens that followed; on a shadow step draft its shadow. True: it drafts nothing now."""
        if not (self._trees or self._shadows) and self._mode != SHADOW:
            return False  # the steady step: nothing to settle
        if self._trees:
            self._pair(request_id, token_ids)
        if self._shadows and request_id in self._shadows:
            self._compare(request_id, token_ids)
        if self._mode == SHADOW:
            self._shadow(request_id, token_ids, most)
            return True
        return False

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        if self._settle(request_id, token_ids, max_tokens):
            return []
        # _length's full-length branch inline: this runs for every request of every step, where
        # each microsecond of Python costs several in the engine (benchmarks/adaptive_overhead.py)
        k = self._length(request_id, max_tokens) if self.per_request else min(max_tokens, self.chain_max)
        if k <= 0 or self._mode == "off":
            return []
        drafts = self.inner.propose(request_id, token_ids, k)
        if not isinstance(drafts, list) or len(drafts) > k:  # any iterable a proposer returns
            drafts = list(drafts)[:k]
        self._step_tokens += len(drafts)
        return drafts

    def propose_tree(self, request_id: str, token_ids: Sequence[int], max_nodes: int) -> tuple[list[int], list[int]]:
        """With a tree proposer (``drafts_trees``): the wrapped proposer's tree in tree mode,
        its chain (as a one-path tree) in chain mode, nothing when off or when this request's
        acceptance says no drafts."""
        if self._settle(request_id, token_ids, max_nodes):
            return [], []
        k = self._length(request_id, max_nodes)
        if k <= 0:
            return [], []
        if self._mode == "tree":
            from .._tree.tree import first_path, is_chain  # torch: only where trees are drafted

            tokens, parents = self.inner.propose_tree(request_id, token_ids, max_nodes)
            tokens, parents = list(tokens)[:max_nodes], list(parents)[:max_nodes]
            if not is_chain(parents):  # branches: a tree step
                self._real_tree = True
                self._trees[request_id] = [len(token_ids), first_path(tokens, parents)[0], None]
        else:
            tokens = list(self.inner.propose(request_id, token_ids, k))[:k]
            parents = list(range(-1, len(tokens) - 1))
        self._step_tokens += len(tokens)
        return tokens, parents

    def finish(self, request_id: str) -> None:
        self._trees.pop(request_id, None)
        self._shadows.pop(request_id, None)
        self.policy.release(request_id)
        self.inner.finish(request_id)

    def describe(self) -> dict[str, Any]:
        return {
            "wraps": self.params.proposer,
            "modes": list(self.modes),
            "chosen_lengths": dict(sorted(self.policy.chosen.items())),
            "cost_c_tokens": round(self.policy.c, 2),
            "cost_samples": self.policy.cost_samples,
            "step_ms": {
                f"B<{2**b}|{m}": round(v * 1e3, 3)
                for b, st in sorted((self.bandit.medians if self.bandit else {}).items())
                for m, v in st.items()
            },
            "steps_by_mode": dict(self.bandit.chosen) if self.bandit else {},
            "tree_gain": round(self.bandit.tree_gain(), 3) if self.bandit and self.drafts_trees else None,
            "live_requests": len(self.policy.stats),
            "inner": self.inner.describe(),
        }
