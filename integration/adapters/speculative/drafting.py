"""The speculative adapter's per-step logic, free of vLLM: :class:`Drafting`.

vLLM's ``custom_class`` proposer (:class:`~.engine.GraftProposer`) hands every call to it:
at the start of a step (from the patched ``GPUModelRunner._update_states``) the requests
that ended and the drafts the step verifies; before sampling (from the patched ``_sample``)
the target's top-k ids per logits row, when the plugin asked for them; after sampling the
batch rows to draft for, with their request ids and token ids.

Acceptance: what the target kept is in each row's ``sampled_token_ids``: the accepted drafts
plus one token of its own. :meth:`Drafting.propose` passes it to ``Proposer.accepted(
request_id, num_accepted, num_verified)`` and counts it. Events (``count(event, n)``):
``propose`` (plugin calls, one per request and step), ``drafted`` (tokens proposed),
``verified`` (drafts vLLM checked), ``accepted`` (drafts it kept), ``finish`` (requests
ended), ``seeded_undrafted`` (drafts discarded for a seeded sampled request, below),
``verified_without_propose`` (below), ``over_max_batch`` (steps of more decoding requests than
the deployment's ``speculative.max_batch``: no plugin call, no drafts).

vLLM's counters: ``verified`` counts what vLLM's ``vllm:spec_decode_num_draft_tokens`` counts and
``accepted`` what ``vllm:spec_decode_num_accepted_tokens`` counts (``Scheduler.update_from_output``:
the drafts scheduled for a request in a step, and its sampled tokens minus one), both in the
step that verified them. ``drafted`` is larger: drafts proposed for a request that then ended, or
that the scheduler cut (token budget, ``max_model_len``, preemption), are never verified. In a
step whose longest request is within ``k`` tokens of ``max_model_len`` vLLM does not call the
drafter (``GPUModelRunner._input_fits_in_drafter``) and schedules ``k`` placeholder drafts (token
id 0) per request instead; the next step counts those as ``verified_without_propose``, and vLLM's
accepted count includes whichever of them the target happened to sample.

Token ids: each call gets a new list of the row's ``token_ids[i, :num_tokens[i]]``, built from a
list the adapter keeps per live request and extends by the tokens each step added
(:meth:`Drafting._tokens`), not from the whole row each step.

Seeded sampling: vLLM's rejection sampler draws a seeded request's random numbers per draft
it verifies, so which tokens the request gets depends on its drafts. Unless the plugin says
its drafts depend only on the request's own tokens (``Proposer.per_request_drafts``), the
drafts of a request with a seed and temperature > 0 are discarded, so the same seed gives the
same text on every run, as in plain vLLM.

The target's top-k: :meth:`Drafting.logits_topk` keeps the step's top-k ids with the rows per
request (a request's drafts plus the bonus row, in ``input_batch`` order); the ``propose``
that follows passes each request its rows with the tokens they follow (the token before the
step, then the drafts the step verified) to ``Proposer.observe_topk``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Collection, Iterable, Mapping, Sequence

from ....hooks import Proposer
from ..plugin_calls import raised
from ....plugins.speculative._tree.tree import first_path, is_chain

log = logging.getLogger("vllm_graft")


class Drafting:
    """What :class:`~.engine.GraftProposer` does each step, free of vLLM (unit-tested on its own).

    ``count(event, n)`` records events; ``k`` is the number of drafts per step vLLM was
    configured with; ``vocab_size`` bounds valid token ids.
    """

    def __init__(
        self,
        plugin: Proposer,
        name: str,
        *,
        k: int,
        max_model_len: int,
        vocab_size: int,
        count: Callable[[str, int], None],
        max_batch: int | None = None,
    ) -> None:
        self.plugin, self.name, self.k = plugin, name, k
        #: the deployment's load limit (``speculative.max_batch``): no drafts in a larger step
        self.max_batch = max_batch
        self.max_model_len, self.vocab_size, self.count = max_model_len, vocab_size, count
        self.verified: dict[str, int] = {}  # request id -> drafts the current step verifies
        self.drafts: dict[str, list[int]] = {}  # request id -> the drafts it verifies
        #: top-k per logits row the plugin asked for (0: none; see the module docstring)
        self.topk = max(0, int(getattr(plugin, "topk", 0) or 0))
        self.pending_topk: tuple[Any, list[int]] | None = None  # (ids [rows, topk], rows/request)
        self.step_tokens = 0  # tokens the current step computes (scheduler_output)
        #: the plugin drafts trees (``Proposer.drafts_trees``; see :mod:`.tree`)
        self.trees_on = bool(getattr(plugin, "drafts_trees", False))
        self.tree_drafts: dict[str, list[int]] = {}  # request id -> parents of its last tree
        #: request id -> (tokens, parents) of the tree the current step verifies
        self.step_trees: dict[str, tuple[list[int], list[int]]] = {}
        #: request id -> its token ids as read last (a private list, extended by the tokens each
        #: step adds; see :meth:`_tokens`)
        self.rows: dict[str, list[int]] = {}

    def step_started(
        self, finished_req_ids: Iterable[str], scheduled_spec_tokens: Mapping[str, Sequence[int]], num_tokens: int = 0
    ) -> None:
        """A step begins: release ended requests, note the drafts it will verify and how many
        tokens it computes."""
        self.step_tokens = int(num_tokens or 0)
        finished = list(finished_req_ids)
        for request_id in finished:
            self.plugin.finish(request_id)
            self.rows.pop(request_id, None)
        if finished:
            self.count("finish", len(finished))
        # Drafts the last step verified that no ``propose`` saw: vLLM skipped the drafter that step
        # and verified placeholder drafts of its own (see the module docstring).
        unseen = sum(self.verified.values())
        if unseen:
            self.count("verified_without_propose", unseen)
        # -1 marks a draft slot vLLM invalidated (structured output): not verified.
        self.verified = {rid: sum(1 for t in toks if t >= 0) for rid, toks in scheduled_spec_tokens.items()}
        if self.topk:
            self.drafts = {rid: list(toks) for rid, toks in scheduled_spec_tokens.items()}
        self.pending_topk = None
        if self.trees_on:  # vLLM may trim drafts (length limit): a tree's first nodes stay a tree
            self.step_trees = {
                rid: ([int(t) for t in toks], self.tree_drafts[rid][: len(toks)])
                for rid, toks in scheduled_spec_tokens.items()
                if len(toks) and rid in self.tree_drafts
            }
            self.tree_drafts = {}

    def logits_topk(self, topk_ids: Any, rows_per_request: Sequence[int]) -> None:
        """The step's top-k ids ``[rows, topk]`` (a CPU numpy array) and how many logits rows
        each batch row has (``input_batch`` order), kept for the ``propose`` that follows."""
        rows = [int(r) for r in rows_per_request]
        self.pending_topk = (topk_ids, rows) if sum(rows) == len(topk_ids) else None

    def _observe_topk(
        self,
        req_ids: Sequence[str | None],
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens: Sequence[int],
        token_ids: Any,
    ) -> None:
        ids, rows = self.pending_topk  # type: ignore[misc]
        self.pending_topk = None
        start = 0
        for i, n_rows in enumerate(rows):
            first, start = start, start + n_rows
            if i >= len(sampled_token_ids) or not len(sampled_token_ids[i]):
                continue  # mid-prefill: its row predicts nothing kept
            request_id = req_ids[i]
            n = int(num_tokens[i])
            before = n - len(sampled_token_ids[i]) - 1  # the last token before this step
            if before < 0 or request_id is None:  # None: an empty slot (it sampled nothing either)
                continue
            context = [int(token_ids[i, before])]
            for t in self.drafts.get(request_id, ()):
                if t < 0:
                    break  # invalidated slot: no position after it
                context.append(int(t))
            m = min(len(context), n_rows)
            self.plugin.observe_topk(request_id, context[:m], ids[first : first + m])

    def propose(
        self,
        req_ids: Sequence[str | None],
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens: Sequence[int],
        token_ids: Any,
        seeded: Collection[str] = (),
        chain_only: Collection[str] = (),
    ) -> list[list[int]]:
        """Drafts per batch row. ``token_ids[i, :num_tokens[i]]`` is row i's sequence so far
        (a 2-D numpy array in vLLM); a row whose ``sampled_token_ids`` is empty (mid-prefill)
        gets no drafts and no plugin call. ``seeded``: the requests sampled with their own
        seed (see the module docstring). ``chain_only``: requests whose sampling the tree
        verifier does not handle (:func:`.tree.tree_verifiable`): a tree plugin's draft is
        cut to its first root-to-leaf path for them, and vLLM verifies that chain."""
        if len(req_ids) < len(sampled_token_ids):
            raise RuntimeError(
                f"vllm-graft speculative adapter: {len(sampled_token_ids)} batch "
                f"rows but only {len(req_ids)} request ids"
            )
        if self.pending_topk is not None:
            self._observe_topk(req_ids, sampled_token_ids, num_tokens, token_ids)
        # False: the plugin drafts nothing this step (Proposer.begin_step), so no row's tokens are
        # copied out for a propose call; accepted() reports still go out below
        decoding = sum(1 for s in sampled_token_ids if len(s))
        if self.max_batch is not None and decoding > self.max_batch:
            # over the deployment's load limit: the plugin is not asked (its begin_step is for a
            # step it drafts in), and the next step runs as plain vLLM's (no drafts to verify)
            drafting = False
            self.count("over_max_batch", 1)
        else:
            drafting = self.plugin.begin_step(decoding, self.step_tokens) is not False
            if not drafting:
                self.count("undrafted_steps", 1)
        out: list[list[int]] = []
        n_calls = n_drafted = n_verified = n_accepted = n_seeded = n_trees = n_cut = 0
        discard = set() if getattr(self.plugin, "per_request_drafts", False) else set(seeded)
        for i, sampled in enumerate(sampled_token_ids):
            if not len(sampled):
                out.append([])
                continue
            request_id = req_ids[i]
            assert request_id is not None, f"batch row {i} has no request"
            verified = self.verified.pop(request_id, 0)
            if verified:
                accepted = min(len(sampled) - 1, verified)
                self.plugin.accepted(request_id, accepted, verified)
                n_verified += verified
                n_accepted += accepted
            if not drafting:
                out.append([])
                continue
            n = int(num_tokens[i])
            budget = min(self.k, self.max_model_len - n)
            if budget <= 0:
                out.append([])
                continue
            if self.trees_on:
                tokens, parents = self._checked_tree(
                    self._call("propose_tree", request_id, self._tokens(request_id, token_ids, i, n), budget),
                    request_id,
                )
                tokens, parents = tokens[:budget], parents[:budget]
                if request_id in chain_only and not is_chain(parents):
                    tokens, parents = first_path(tokens, parents)
                    n_cut += 1
                drafts = tokens
                if not is_chain(parents) and request_id not in discard:
                    self.tree_drafts[request_id] = parents
                    n_trees += 1
            else:
                drafts = self._checked(
                    self._call("propose", request_id, self._tokens(request_id, token_ids, i, n), budget), request_id
                )
                if len(drafts) > budget:
                    self._too_many(len(drafts), budget)
                    drafts = drafts[:budget]
            n_calls += 1
            if request_id in discard:
                n_seeded += len(drafts)
                drafts = []
            n_drafted += len(drafts)
            out.append(drafts)
        for event, n in (
            ("propose", n_calls),
            ("drafted", n_drafted),
            ("verified", n_verified),
            ("accepted", n_accepted),
            ("seeded_undrafted", n_seeded),
            ("trees", n_trees),
            ("tree_cut_to_chain", n_cut),
        ):
            if n:
                self.count(event, n)
        return out

    def _tokens(self, request_id: str, token_ids: Any, row: int, n: int) -> list[int]:
        """Row ``row``'s first ``n`` token ids as a new list. A request's tokens before its
        ``num_tokens_no_spec`` do not change while it lives (vLLM appends what each step
        accepted), so only the tokens added since its last call are read from the matrix; the
        rest is copied from the list kept for it, a copy that costs about a ninth of numpy's
        ``tolist`` (at 2,000 tokens 3 against 26 microseconds, 32 rows a step). The kept list is
        read anew from the matrix when the row is shorter than it or its first or last kept
        token differs there (the id reused for another request), and dropped when the request
        ends."""
        kept = self.rows.get(request_id)
        m = len(kept) if kept is not None else 0
        if not m or m > n or kept[0] != token_ids[row, 0] or kept[m - 1] != token_ids[row, m - 1]:  # type: ignore[index]
            kept = self.rows[request_id] = token_ids[row, :n].tolist()
        elif m < n:
            kept.extend(token_ids[row, m:n].tolist())  # type: ignore[union-attr]
        return kept[:n]  # type: ignore[index]  # a copy: a plugin may keep or change what it is given

    def _call(self, method: str, request_id: str, token_ids: list[int], budget: int) -> Any:
        """The plugin's ``propose``/``propose_tree``; an exception names the plugin."""
        try:
            return getattr(self.plugin, method)(request_id, token_ids, budget)
        except Exception as e:
            raise raised("speculative", self.name, f"{method}()", e) from e

    def _too_many(self, got: int, budget: int) -> None:
        """More drafts than asked: the contract drops the extra ones; said once per plugin."""
        if not getattr(self, "_warned_extra", False):
            self._warned_extra = True
            log.warning(
                "vllm-graft: speculative plugin %r proposed %d drafts where %d were asked "
                "(max_tokens); the extra ones are dropped (Proposer.propose), this time and "
                "every later time (said once)",
                self.name,
                got,
                budget,
            )

    def _checked(self, drafts: Any, request_id: str) -> list[int]:
        try:
            if isinstance(drafts, (str, bytes, dict, set)):  # iterable, but not a list of ids
                raise TypeError
            tokens = [int(t) for t in drafts]
            ok = all(0 <= t < self.vocab_size for t in tokens)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(
                f"speculative plugin {self.name!r} proposed {drafts!r} for request {request_id!r}; "
                f"propose() must return a list of token ids in [0, {self.vocab_size})"
            )
        return tokens

    def _checked_tree(self, tree: Any, request_id: str) -> tuple[list[int], list[int]]:
        try:
            tokens, parents = tree
            tokens = self._checked(tokens, request_id)
            parents = [int(p) for p in parents]
            ok = len(parents) == len(tokens) and all(-1 <= p < i for i, p in enumerate(parents))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(
                f"speculative plugin {self.name!r} proposed the tree {tree!r} for request "
                f"{request_id!r}; propose_tree() must return (tokens, parents) of equal length "
                "with -1 <= parents[i] < i (-1: the node follows the request's last token)"
            )
        return tokens, parents


__all__ = ["Drafting", "first_path", "is_chain"]
