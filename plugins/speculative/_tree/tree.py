"""The draft tree: the candidate continuations a proposer offers for one sequence, as one tree
(SpecInfer's "token tree"; Medusa's and Token Recycling's static trees are special cases).

Nodes are numbered ``0..N-1`` in topological order. ``tokens[i]`` is node ``i``'s token and
``parents[i]`` its parent's index, or ``-1`` when its parent is the *root*: the sequence's last
verified token, which is not a node. ``parents[i] < i`` always, so one pass in index order sees
every parent before its children. Siblings are ordered by index: verification tries them in that
order (:mod:`.verify`), so a proposer puts its most likely candidate first.

Example, the chains ``[5, 6, 7]``, ``[5, 8]`` and ``[9]`` merged by :meth:`DraftTree.from_chains`::

    root ─┬─ 0:5 ─┬─ 1:6 ── 2:7         tokens  = [5, 6, 7, 8, 9]
          │       └─ 3:8                parents = [-1, 0, 1, 0, -1]
          └─ 4:9                        depth   = [1, 2, 3, 2, 1]

In a verify pass node ``i`` sits at position ``root_position + depth[i]``, and attends to the
context (the root included) and to its ancestors-or-self: :func:`ancestor_mask`, the mask of
:func:`.reference.tree_attention`. When the root itself is computed in the same forward pass
(as a decode step feeds the bonus token back), :meth:`DraftTree.with_root` makes it node 0.

The structure lives on the host (it is small: tens of nodes); its tensors are int64 CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

ROOT = -1


def _as_long_1d(values: "torch.Tensor | Sequence[int]", name: str) -> torch.Tensor:
    t = torch.as_tensor(values)
    if t.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {tuple(t.shape)}")
    if t.numel() and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
        raise ValueError(f"{name} must hold integers, got {t.dtype}")
    return t.to(device="cpu", dtype=torch.long)


def check_parents(parents: "torch.Tensor | Sequence[int]") -> torch.Tensor:
    """``parents`` as an int64 CPU tensor, after checking that each entry is ``-1`` or an earlier
    node (``-1 <= parents[i] < i``); ``ValueError`` naming the first bad node otherwise."""
    p = _as_long_1d(parents, "parents")
    n = p.numel()
    idx = torch.arange(n)
    bad = (p < ROOT) | (p >= n)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"parents[{i}] = {int(p[i])} is out of range: a parent is -1 (the root) or a node index in [0, {n})"
        )
    bad = p >= idx
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"parents[{i}] = {int(p[i])} is not before node {i}: nodes must be in topological order (parents[i] < i)"
        )
    return p


def ancestor_mask(parents: "torch.Tensor | Sequence[int]") -> torch.Tensor:
    """``mask [N, N]`` (bool): ``mask[i, j]`` is True when node ``j`` is node ``i`` or one of its
    ancestors. Row ``i`` is its parent's row plus ``i`` itself (one pass in index order)."""
    p = check_parents(parents).tolist()
    n = len(p)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, parent in enumerate(p):
        if parent != ROOT:
            mask[i] = mask[parent]
        mask[i, i] = True
    return mask


def is_chain(parents: Sequence[int]) -> bool:
    """Whether a tree's ``parents`` make a single chain (node i follows node i - 1): vLLM's own
    chain verification then applies unchanged."""
    return all(p == i - 1 for i, p in enumerate(parents))


def first_path(tokens: Sequence[int], parents: Sequence[int]) -> tuple[list[int], list[int]]:
    """The tree's first root-to-leaf path (each node's first child in index order), as a chain."""
    path: list[int] = []
    node = -1
    for i, p in enumerate(parents):
        if p == node:
            path.append(tokens[i])
            node = i
    return path, list(range(-1, len(path) - 1))


def merge_chains(chains: Iterable[Sequence[int]], max_nodes: int | None = None) -> tuple[list[int], list[int]]:
    """``(tokens, parents)`` of the tree that merges ``chains`` (:meth:`DraftTree.from_chains`'s
    numbering), as plain lists, cut to the first ``max_nodes`` nodes (a prefix of a topological
    order is a tree). A proposer that drafts a tree every step calls this rather than building a
    :class:`DraftTree`, whose tensors and checks cost several times the merge for tens of nodes
    (the tree deployment's ``Drafting.propose`` at batch 1 went from 0.39 to 0.13-0.14 ms a
    step with ``lookahead``; docs/benchmarks/speculative.md)."""
    index: dict[tuple[int, int], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    limit = -1 if max_nodes is None else max(0, int(max_nodes))
    for chain in chains:
        parent = ROOT
        for tok in chain:
            key = (parent, int(tok))
            node = index.get(key)
            if node is None:
                if len(tokens) == limit:
                    return tokens, parents
                node = index[key] = len(tokens)
                tokens.append(key[1])
                parents.append(parent)
            parent = node
    return tokens, parents


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A draft tree (see the module docstring). ``tokens`` and ``parents`` are ``[N]`` (lists or
    tensors; stored as int64 CPU tensors); ``depth [N]`` is derived (1 for the root's children).
    An empty tree (``N = 0``) is valid: verification then accepts nothing."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor = field(init=False, repr=False)
    _children: tuple = field(init=False, repr=False)

    def __post_init__(self) -> None:
        tokens = _as_long_1d(self.tokens, "tokens")
        parents = check_parents(self.parents)
        if tokens.numel() != parents.numel():
            raise ValueError(f"tokens and parents differ in length: {tokens.numel()} != {parents.numel()}")
        if tokens.numel() and int(tokens.min()) < 0:
            raise ValueError(f"token ids must be non-negative, got {int(tokens.min())}")
        plist = parents.tolist()
        depth: list[int] = []
        children: list[list[int]] = [[] for _ in range(len(plist) + 1)]  # [0] is the root's
        for i, p in enumerate(plist):
            depth.append(1 if p == ROOT else depth[p] + 1)
            children[p + 1].append(i)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "depth", torch.tensor(depth, dtype=torch.long))
        object.__setattr__(self, "_children", tuple(tuple(c) for c in children))

    def __len__(self) -> int:
        return self.tokens.numel()

    def children(self, node: int = ROOT) -> tuple[int, ...]:
        """The children of ``node`` (``-1``: the root's), in index order."""
        return self._children[node + 1]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``."""
        out = []
        while node != ROOT:
            out.append(node)
            node = int(self.parents[node])
        return out[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        """``[N, N]`` bool, True where column ``j`` is an ancestor-or-self of row ``i``."""
        return ancestor_mask(self.parents)

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node lists, one per leaf, leaves in index order."""
        return [self.path_to(i) for i in range(len(self)) if not self.children(i)]

    def with_root(self, token: int) -> "DraftTree":
        """The same tree with the root as node 0 (token ``token``) and every other node shifted
        by one: the ``N + 1`` queries of a verify pass that also computes the root."""
        parents = torch.cat([torch.tensor([ROOT]), self.parents + 1])  # -1 (the root) becomes 0
        return DraftTree(torch.cat([torch.tensor([int(token)]), self.tokens]), parents)

    @classmethod
    def from_chains(cls, chains: Iterable[Sequence[int]]) -> "DraftTree":
        """Merge candidate continuations into one tree: chains that share a prefix share its
        nodes. Nodes are numbered in order of first appearance (each chain's new nodes after
        the previous chains'), so earlier chains' tokens come first among siblings. Empty
        chains add nothing; a chain that is a prefix of another adds nothing either."""
        tokens, parents = merge_chains(chains)
        return cls(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    @classmethod
    def from_nodes(cls, nodes: Sequence[tuple[int, int]]) -> "DraftTree":
        """From ``[(token, parent)]`` pairs, the form Token Recycling's ``RecyclingMatrix.tree``
        returns (node ``i`` is pair ``i``; parent ``-1`` is the root)."""
        return cls(
            torch.tensor([t for t, _ in nodes], dtype=torch.long), torch.tensor([p for _, p in nodes], dtype=torch.long)
        )
