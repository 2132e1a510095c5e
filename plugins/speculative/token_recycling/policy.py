"""Token Recycling (Luo et al., "Turning Trash into Treasure: Accelerating Inference of Large
Language Models with Token Recycling", arXiv:2408.08696), the policy as NumPy.

An adjacency ("successor") matrix ``M [vocab, k]``: row ``t`` holds the ``k`` tokens the
target most recently ranked highest as the next token after ``t``. Every verify step
overwrites, for each position it computed logits for, the row of that position's token with
the step's top-k there (the candidate tokens a normal decoder throws away: "recycled"). The
matrix is shared by all requests and kept across them; its size is fixed (``vocab x k``).

Drafting walks the matrix from the sequence's last token. The paper builds a static
*tree* (breadth per depth) from the matrix and verifies it with tree attention; vLLM's
rejection sampler verifies chains only, so :meth:`RecyclingMatrix.chain` drafts the most
probable path (column 0 at each depth). :meth:`RecyclingMatrix.tree` builds the paper's
tree for a future tree verifier (not used by vLLM today).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

#: Marks an empty matrix cell (no successor seen yet).
EMPTY = -1


class RecyclingMatrix:
    """The ``vocab x k`` successor matrix. Rows grow on demand (to the largest token id seen,
    rounded up to a power of two, capped by ``vocab_size`` when given)."""

    def __init__(self, k: int, vocab_size: int | None = None) -> None:
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        self.k = k
        self.vocab_size = vocab_size
        rows = vocab_size if vocab_size else 1024
        self.m: np.ndarray = np.full((rows, k), EMPTY, dtype=np.int64)
        self.updates = 0  # rows written

    @property
    def nbytes(self) -> int:
        return int(self.m.nbytes)

    def _grow(self, max_token: int) -> None:
        if max_token < len(self.m):
            return
        if self.vocab_size is not None and max_token >= self.vocab_size:
            raise ValueError(f"token id {max_token} is outside the vocabulary ({self.vocab_size})")
        rows = 1 << int(max_token).bit_length()
        if self.vocab_size is not None:
            rows = min(rows, self.vocab_size)
        grown: np.ndarray = np.full((rows, self.k), EMPTY, dtype=np.int64)
        grown[: len(self.m)] = self.m
        self.m = grown

    def update(self, tokens: Sequence[int], topk_ids: np.ndarray) -> None:
        """Row ``tokens[j]`` becomes ``topk_ids[j]`` (the target's top-k after it), for each j;
        a later j wins when a token repeats. ``topk_ids`` may have more or fewer than ``k``
        columns: the first ``k`` are kept, missing ones are left empty."""
        rows = np.asarray(tokens, dtype=np.int64).reshape(-1)
        ids = np.asarray(topk_ids, dtype=np.int64).reshape(len(rows), -1)
        if not len(rows):
            return
        if rows.min() < 0:
            raise ValueError("token ids must be non-negative")
        self._grow(int(rows.max()))
        width = min(self.k, ids.shape[1])
        self.m[rows, :width] = ids[:, :width]
        if width < self.k:
            self.m[rows, width:] = EMPTY
        self.updates += len(rows)

    def successors(self, token: int) -> np.ndarray:
        """The row of ``token`` (empty cells are :data:`EMPTY`)."""
        if not 0 <= token < len(self.m):
            return np.full(self.k, EMPTY, dtype=np.int64)
        return self.m[token]

    def chain(self, last: int, length: int) -> list[int]:
        """The most probable path of the tree: follow column 0 from ``last`` for up to
        ``length`` tokens, stopping at an empty cell."""
        out: list[int] = []
        t = int(last)
        for _ in range(max(0, length)):
            if not 0 <= t < len(self.m):
                break
            nxt = int(self.m[t, 0])
            if nxt == EMPTY:
                break
            out.append(nxt)
            t = nxt
        return out

    def tree(self, last: int, breadth: Sequence[int]) -> list[tuple[int, int]]:
        """The paper's static draft tree from ``last``: depth ``d`` (1-based) expands each node
        of depth ``d-1`` with at most ``breadth[d-1]`` of its successors, the top
        children first (the first node of every depth extends the most probable path).

        Returns ``[(token, parent_index)]`` in breadth-first order; parent ``-1`` is the root
        ``last``. Index ``i`` in the list is node ``i``. A tree verifier would check all
        nodes in one forward pass (tree attention mask from the parents)."""
        nodes: list[tuple[int, int]] = []
        frontier = [(-1, int(last))]
        for width in breadth:
            if width <= 0:
                break
            nxt: list[tuple[int, int]] = []
            for parent_idx, tok in frontier:
                for child in self.successors(tok)[:width]:
                    if int(child) == EMPTY:
                        break
                    nodes.append((int(child), parent_idx))
                    nxt.append((len(nodes) - 1, int(child)))
            frontier = nxt
            if not frontier:
                break
        return nodes


def tree_paths(nodes: Sequence[tuple[int, int]]) -> list[list[int]]:
    """Root-to-leaf token paths of a tree from :meth:`RecyclingMatrix.tree`."""
    has_child = {p for _, p in nodes}
    paths = []
    for i, _ in enumerate(nodes):
        if i in has_child:
            continue
        path, j = [], i
        while j != -1:
            path.append(nodes[j][0])
            j = nodes[j][1]
        paths.append(path[::-1])
    return paths
