"""Token Recycling proposer (CPU path) and the oracle of the matrix-update kernel."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ....hooks import Proposer

from .policy import RecyclingMatrix


def topk_update_reference(logits: "Any", tokens: "Any", matrix: "Any") -> "Any":
    """The tensor-shaped step, in PyTorch: ``matrix[tokens[r]] = topk(logits[r], k)`` for each
    row ``r`` of ``logits [R, V]`` (``k = matrix.shape[1]``; ties: lower token id first; a
    token repeated in ``tokens``: the last row wins). Updates ``matrix`` in place, returns it.
    """
    import torch

    k = matrix.shape[1]
    v = logits.shape[1]
    # Stable order: sort by (-logit, id), as the kernel's iterative argmax does.
    order = torch.argsort(-logits.float(), dim=1, stable=True)[:, :k]
    if k > v:
        raise ValueError(f"k={k} exceeds the vocabulary {v}")
    for r in range(logits.shape[0]):  # sequential: the last row for a token wins
        matrix[int(tokens[r])] = order[r].to(matrix.dtype)
    return matrix


class TokenRecycling(Proposer):
    """Drafts the most probable path through the successor matrix (see ``policy``)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params)
        self.topk = params.k  # asks the adapter for the verify step's top-k (observe_topk)
        self.matrix = RecyclingMatrix(params.k, params.vocab_size)
        self.drafts_trees = bool(getattr(params, "tree", False))  # tree mode (propose_tree)
        self.proposed = self.drafted = self.observed_rows = 0

    def observe_topk(self, request_id: str, tokens: Sequence[int], topk_ids: Any) -> None:
        self.matrix.update(tokens, np.asarray(topk_ids))
        self.observed_rows += len(tokens)

    def update_from_logits(self, tokens: Any, logits: Any) -> None:
        """The same update from raw logits ``[R, V]`` (row r follows ``tokens[r]``): FlashInfer's
        top-k or the Triton kernel when the logits are on a GPU, else the PyTorch reference. (The
        vLLM adapter passes top-k ids to :meth:`observe_topk` instead; this is the device-side
        route.)"""
        import torch

        tokens = torch.as_tensor(tokens, device=logits.device).reshape(-1)
        if not len(tokens):
            return
        self.matrix._grow(int(tokens.max()))
        width = min(self.matrix.k, int(logits.shape[1]))
        out = torch.full((len(self.matrix.m), width), -1, dtype=torch.int64, device=logits.device)
        if logits.is_cuda:  # FlashInfer's top_k where it may run, else the Triton kernel
            from .flashinfer import recycle_update

            recycle_update(logits, tokens, out)
        else:
            topk_update_reference(logits, tokens, out)
        rows = torch.unique(tokens).cpu().numpy()
        self.matrix.m[rows, :width] = out[torch.as_tensor(rows, device=logits.device)].cpu().numpy()
        self.matrix.updates += len(tokens)
        self.observed_rows += len(tokens)

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        n = min(max_tokens, self.params.num_speculative_tokens)
        drafts = self.matrix.chain(token_ids[-1], n) if token_ids else []
        self.proposed += 1
        self.drafted += len(drafts)
        return drafts

    def propose_tree(self, request_id: str, token_ids: Sequence[int], max_nodes: int) -> tuple[list[int], list[int]]:
        nodes = self.matrix.tree(token_ids[-1], self.params.tree_breadth)[:max_nodes] if token_ids else []
        self.proposed += 1
        self.drafted += len(nodes)
        return [t for t, _ in nodes], [p for _, p in nodes]

    def describe(self) -> dict[str, Any]:
        return {
            "matrix_rows": len(self.matrix.m),
            "k": self.matrix.k,
            "matrix_bytes": self.matrix.nbytes,
            "rows_observed": self.observed_rows,
            "proposals": self.proposed,
            "drafted": self.drafted,
        }
