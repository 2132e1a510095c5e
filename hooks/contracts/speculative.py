"""The speculative contract: a proposer of draft tokens."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Sequence

from ..kinds import Kind
from .base import P, PluginImpl


#: The parameter that turns a proposer's tree drafting on (see :attr:`Proposer.drafts_trees`).
TREE_FIELD = "tree"


class Proposer(PluginImpl[P]):
    """Proposes draft tokens; the target model verifies them (chain verification: the
    longest prefix of the drafts that the target would have produced itself is kept, so
    greedy output does not depend on the drafts).

    How many tokens: if the plugin's parameter model has a field ``num_speculative_tokens``,
    its value is the most drafts per step (vLLM reserves that many verification slots per
    request); otherwise the adapter uses ``DEFAULT_NUM_SPECULATIVE_TOKENS`` (4). Each call's
    ``max_tokens`` is that number, or less near the model's length limit.

    Calls, per request and engine step once the request has produced a token:
    ``accepted`` (how the previous drafts fared, when there were any), then ``propose``.
    ``finish`` comes once the request has ended (finished or aborted), with the engine's
    next step: that is when vLLM tells its workers.
    """

    kind = Kind.SPECULATIVE

    @abstractmethod
    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` draft tokens to follow ``token_ids``.

        ``token_ids`` is the request's whole sequence so far: prompt, then every output
        token (the one just sampled last). Return fewer, or ``[]``, when unsure; extra
        tokens beyond ``max_tokens`` are dropped. ``request_id`` is stable for the request's
        life, so per-request state can be kept under it until :meth:`finish`.
        """

    def accepted(self, request_id: str, num_accepted: int, num_verified: int) -> None:
        """The target kept the first ``num_accepted`` of the ``num_verified`` drafts it
        checked for ``request_id`` in the step just run (the drafts this plugin proposed
        last; vLLM verifies fewer when it trims them, e.g. at the length limit). For
        adaptive draft lengths and acceptance statistics. Default: nothing."""

    def finish(self, request_id: str) -> None:
        """The request ended (finished or aborted): release its state. Default: nothing."""

    # ---- optional extras; a proposer that does not ask for them costs nothing extra ----
    #: True when a request's drafts depend only on that request's own tokens (like vLLM's
    #: prompt-lookup ``ngram``). False (the default): they may depend on other requests
    #: (a shared trie, a shared token matrix), so the same request drafts differently from one
    #: run to the next. Under sampling, which tokens a seeded request gets depends on its
    #: drafts, so for a request with a ``seed`` and temperature > 0 the adapter discards
    #: the drafts of such a proposer (``propose`` is still called, so it keeps learning):
    #: the same seed then gives the same text, as it does in plain vLLM.
    per_request_drafts: bool = False

    #: How many of the target's most probable next tokens per verified position this
    #: proposer wants through :meth:`observe_topk` (Token Recycling). 0 (the default): the
    #: adapter computes no top-k and never calls :meth:`observe_topk`. Read once, when the
    #: adapter builds the proposer (a class attribute or one set in ``__init__``).
    topk: int = 0

    def observe_topk(self, request_id: str, tokens: Sequence[int], topk_ids: Any) -> None:
        """What the target predicted in the step just run, called before :meth:`accepted`
        and :meth:`propose` of that step, only when :attr:`topk` > 0.

        ``topk_ids`` is an int array ``[len(tokens), topk]``: row ``j`` holds the target's
        ``topk`` most probable next tokens (most probable first) after the prefix ending in
        ``tokens[j]``. ``tokens`` are the positions the step computed logits for: the
        request's last token before the step, then each draft token the step verified (in
        order; rows after the first rejected draft were computed on a rejected prefix, but
        still say what tends to follow that token). Default: nothing."""

    #: True when this proposer drafts token *trees* (:meth:`propose_tree`), verified in one
    #: target forward with a tree attention mask; the longest correct root-to-node path is
    #: accepted. Read once, when the adapter builds the proposer (a class attribute or one set
    #: in ``__init__``). False (the default): :meth:`propose` drafts a chain. Where trees are
    #: turned on by a boolean parameter named ``tree`` (:data:`TREE_FIELD`, as the built-ins
    #: do), deployment validation refuses what tree verification cannot run with (attention and
    #: kvcompress plugins, tensor or pipeline parallelism); a proposer that sets it otherwise
    #: meets the same refusals when the engine starts.
    drafts_trees: bool = False

    def propose_tree(self, request_id: str, token_ids: Sequence[int], max_nodes: int) -> tuple[list[int], list[int]]:
        """A draft tree of at most ``max_nodes`` nodes to follow ``token_ids`` (only when
        :attr:`drafts_trees`; then asked instead of :meth:`propose`).

        Returns ``(tokens, parents)``, one entry per node: node ``i`` carries token
        ``tokens[i]`` and follows node ``parents[i]`` (``-1``: it follows the last token of
        ``token_ids``); parents come first (``parents[i] < i``). Siblings should carry
        different tokens. ``([], [])`` when unsure; nodes beyond ``max_nodes`` are dropped
        (the first ``max_nodes`` still form a tree). Under greedy decoding the longest path
        whose every token is the target's own choice is accepted; under sampling each node is
        accepted by the standard rejection rule (a tree's drafts are taken as deterministic),
        so output does not depend on the tree either way. ``accepted`` then reports the
        accepted path's length and the number of nodes verified."""
        raise NotImplementedError(f"{type(self).__name__} sets drafts_trees but implements no propose_tree()")

    def fresh_drafting_state(self) -> None:
        """Forget what drafts draw on across requests (tries, token tables), keeping the
        parameters; called by the bench and demo before each timed run, which repeat the same
        prompts, so that no run drafts the previous run's outputs back (only for proposers
        that are not :attr:`per_request_drafts`). Default: ``__init__`` again with the same
        parameters. A proposer that also learns about the engine rather than the text (e.g.
        ``adaptive``'s measured step costs) may keep that part."""
        type(self).__init__(self, self.params)

    def begin_step(self, num_requests: int, num_tokens: int = 0) -> bool | None:
        """A step's drafting begins; ``num_requests`` requests will be asked to
        :meth:`propose` (the batch size, for adaptive draft lengths). ``num_tokens`` is how
        many tokens the target computed in the step just run (prompt chunks, one per
        decoding request, the drafts it verified; 0 when unknown).

        Return ``False`` when the proposer drafts nothing for any request this step (e.g.
        ``adaptive`` with speculation off): the adapter then skips this step's
        :meth:`propose` calls (and their copy of each request's tokens), while
        :meth:`accepted` reports still arrive. ``None`` (the default) or ``True``:
        :meth:`propose` is asked per request as usual."""
        return None
