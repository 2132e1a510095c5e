"""Verification of a draft tree against the target model's outputs of one verify pass.

The pass gives the target's prediction at the root (index 0: what follows the last verified
token) and at every node (index ``i + 1``: what follows node ``i``'s path). Verification picks
one root-to-node path to accept and a *bonus* token (the target's own token after it), so a
step always emits ``len(accepted) + 1`` tokens.

* :func:`verify_greedy`: argmax decoding. A node is correct when its token is the target's
  argmax at its parent, and the accepted path is the longest path of correct nodes.
* :func:`verify_sampling`: sampling, lossless (the emitted tokens are distributed exactly as
  if sampled from the target one at a time), by recursive rejection sampling (SpecInfer,
  Miao et al. 2023, arXiv:2305.09781): at a node with residual target distribution ``p``, its
  children are tried in index order; child ``c`` with token ``x`` drawn from ``q_c`` is
  accepted with probability ``min(1, p(x) / q_c(x))``; on rejection
  ``p <- normalize(max(p - q_c, 0))`` and the next child is tried; when every child is
  rejected (or there are none) the bonus is sampled from ``p``. An accepted child becomes the
  current node with ``p`` its own target distribution.

  Why it is lossless: trying one child emits ``y`` with probability ``min(p(y), q_c(y))`` and
  rejects with probability ``Z = sum(max(p - q_c, 0))``; with everything after a rejection
  distributed as ``max(p - q_c, 0) / Z`` (by induction over the remaining children, the last
  step being a sample from the residual), the total is ``min(p, q_c) + max(p - q_c, 0) = p``.
  This needs ``x`` to be drawn from ``q_c`` given what came before: ``draft_probs[c]`` must be
  the distribution node ``c``'s token was actually drawn from. Children drawn independently
  from one distribution (SpecInfer's i.i.d. samples) pass it for every child; siblings drawn
  without replacement pass each child's conditional distribution (the earlier siblings'
  tokens removed); deterministic drafts (top-k, a static tree) pass a one-hot ``q``, which
  makes the rule "accept ``x`` with probability ``p(x)``, else zero ``p(x)`` and renormalise".
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from .tree import ROOT, DraftTree


class Verdict(NamedTuple):
    """What a verify step emits: ``accepted`` node indices (root's child first) and the target's
    ``bonus`` token after the last of them (after the root when none is accepted)."""

    accepted: list[int]
    bonus: int

    def tokens(self, tree: DraftTree) -> list[int]:
        """The emitted token ids: the accepted nodes' tokens, then the bonus."""
        return [int(tree.tokens[i]) for i in self.accepted] + [self.bonus]


def verify_greedy(tree: DraftTree, target_tokens: "torch.Tensor | Sequence[int]") -> Verdict:
    """Greedy verification. ``target_tokens [N + 1]``: the target's argmax at the root (index 0)
    and after each node ``i`` (index ``i + 1``).

    Node ``i`` is correct when ``tokens[i] == target_tokens[parents[i] + 1]``; the accepted path
    is the longest root-to-node path of correct nodes, and the bonus is the target's argmax
    after its last node. Ties between siblings: when several children of a node are correct
    (only possible when siblings carry the same token, which :meth:`DraftTree.from_chains`
    never builds), the one whose correct continuation is longest wins, and among equally long
    ones the first child in index order. (Equal siblings share their token path, so a real
    target predicts the same after both: the choice decides how many tokens the step emits,
    never which.) The walk down the tree's first correct children, which
    :func:`verify_sampling` reduces to with one-hot targets, differs only in such ties.
    """
    target = torch.as_tensor(target_tokens).reshape(-1).tolist()
    n = len(tree)
    if len(target) != n + 1:
        raise ValueError(f"target_tokens must have N + 1 = {n + 1} entries, got {len(target)}")
    tokens = tree.tokens.tolist()
    # length of the longest correct path below each node (children have larger indices)
    below = [0] * n
    best = [ROOT] * (n + 1)  # best[i + 1]: the child to follow from node i (-1 for the root)
    for i in range(n - 1, ROOT - 1, -1):
        for c in tree.children(i):
            if tokens[c] == target[i + 1] and (best[i + 1] == ROOT or below[c] > below[best[i + 1]]):
                best[i + 1] = c
        if i != ROOT:
            below[i] = 0 if best[i + 1] == ROOT else below[best[i + 1]] + 1
    accepted, node = [], ROOT
    while best[node + 1] != ROOT:
        node = best[node + 1]
        accepted.append(node)
    return Verdict(accepted, int(target[node + 1]))


def verify_sampling(
    tree: DraftTree, target_probs: torch.Tensor, draft_probs: torch.Tensor, generator: torch.Generator | None = None
) -> Verdict:
    """Lossless verification under sampling (recursive rejection sampling; see the module
    docstring). ``target_probs [N + 1, V]``: the target's distribution at the root (row 0) and
    after each node (row ``i + 1``); ``draft_probs [N, V]``: the distribution node ``i``'s token
    was drawn from. Rows need not be normalised. Runs on the host in float64; every random draw
    comes from ``generator`` on the generator's own device (vLLM's per-request generators are
    CUDA generators on CUDA), read back one draw at a time. A draft token the draft gave zero
    probability is accepted when the target gives it any (the limit of ``p(x) / q(x)``).
    """
    n = len(tree)
    if target_probs.ndim != 2 or target_probs.shape[0] != n + 1:
        raise ValueError(f"target_probs must be [N + 1, V] with N + 1 = {n + 1}, got {tuple(target_probs.shape)}")
    vocab = target_probs.shape[1]
    if tuple(draft_probs.shape) != (n, vocab):
        raise ValueError(f"draft_probs must be [N, V] = {(n, vocab)}, got {tuple(draft_probs.shape)}")
    if n and int(tree.tokens.max()) >= vocab:
        raise ValueError(f"a draft token ({int(tree.tokens.max())}) is outside the vocabulary ({vocab})")
    target = target_probs.detach().to("cpu", torch.float64)
    draft = draft_probs.detach().to("cpu", torch.float64)
    tokens = tree.tokens.tolist()
    draws = generator.device if generator is not None else torch.device("cpu")
    accepted: list[int] = []
    node = ROOT
    while True:
        p = target[node + 1] / target[node + 1].sum()
        for c in tree.children(node):
            x = tokens[c]
            q = draft[c] / draft[c].sum()
            u = float(torch.rand((), generator=generator, dtype=torch.float64, device=draws))
            if u * float(q[x]) < float(p[x]):  # u < p(x) / q(x), without dividing
                accepted.append(c)
                node = c
                break
            residual = (p - q).clamp_(min=0.0)
            total = float(residual.sum())
            if total > 0.0:  # 0 only when p == q, where rejecting has probability 0
                p = residual / total
        else:
            bonus = int(torch.multinomial(p.to(draws), 1, generator=generator))
            return Verdict(accepted, bonus)
