"""Tree attention for one sequence in plain PyTorch: the oracle of :mod:`.kernel`.

A verify pass runs the target model once over all ``N`` nodes of a draft tree. Node ``i``'s
query attends to

* the sequence's verified context: ``context_len`` tokens whose keys and values are in a paged
  cache, token ``t`` in block ``block_table[t // block_size]`` at slot ``t % block_size``;
* the tree nodes that are its ancestors-or-self (:func:`.tree.ancestor_mask`), whose keys and
  values this pass computed (``k_tree``/``v_tree``; not in the cache: only the accepted ones
  will be written there, after verification).

So each node sees exactly what it would see if its root-to-node path had been decoded as a
plain sequence, and one pass scores every candidate path.

Shapes: ``q [N, Hq, D]``; ``k_cache``/``v_cache [num_blocks, block_size, Hkv, D]`` (any strides:
a permuted view of a ``[num_blocks, Hkv, block_size, D]`` cache works); ``block_table [>= ceil(
context_len / block_size)]`` (int); ``k_tree``/``v_tree [N, Hkv, D]``; ``parents [N]``;
``out [N, Hq, D]`` in ``q``'s dtype. Grouped-query attention: query head ``h`` reads kv head
``h // (Hq // Hkv)``. Scores and softmax in float32.
"""

from __future__ import annotations

import torch

from .tree import ancestor_mask


def check_shapes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    parents: torch.Tensor,
) -> tuple[int, int, int, int, int]:
    """``(N, Hq, Hkv, D, block_size)`` after checking the arguments agree; ``ValueError`` naming
    the argument otherwise."""
    if q.ndim != 3:
        raise ValueError(f"q must be [N, Hq, D], got shape {tuple(q.shape)}")
    n, hq, d = q.shape
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, Hkv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    _, bs, hkv, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"head size differs: q has {d}, the cache {dk}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"the query heads ({hq}) must be a multiple of the kv heads ({hkv})")
    for name, t in (("k_tree", k_tree), ("v_tree", v_tree)):
        if tuple(t.shape) != (n, hkv, d):
            raise ValueError(f"{name} must be [N, Hkv, D] = {(n, hkv, d)}, got {tuple(t.shape)}")
    if tuple(parents.shape) != (n,):
        raise ValueError(f"parents must be [N] = [{n}], got {tuple(parents.shape)}")
    if context_len < 0:
        raise ValueError(f"context_len must be >= 0, got {context_len}")
    need = -(-context_len // bs)
    if block_table.ndim != 1 or block_table.numel() < need:
        raise ValueError(
            f"block_table must be 1-D with at least {need} entries for {context_len} "
            f"context tokens in blocks of {bs}, got shape {tuple(block_table.shape)}"
        )
    return n, hq, hkv, d, bs


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    parents: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``out [N, Hq, D]``: softmax attention of each node over the context and its
    ancestors-or-self (see the module docstring)."""
    context_len = int(context_len)
    n, hq, hkv, d, bs = check_shapes(q, k_cache, v_cache, block_table, context_len, k_tree, v_tree, parents)
    nb = -(-context_len // bs)
    ids = block_table[:nb].long().to(k_cache.device)
    # the context's keys/values in token order: [context_len, Hkv, D]
    k_ctx = k_cache[ids].reshape(nb * bs, hkv, d)[:context_len]
    v_ctx = v_cache[ids].reshape(nb * bs, hkv, d)[:context_len]
    keys = torch.cat([k_ctx, k_tree.to(k_ctx.dtype)]).float()  # [L + N, Hkv, D]
    values = torch.cat([v_ctx, v_tree.to(v_ctx.dtype)]).float()
    group = hq // hkv
    keys = keys.repeat_interleave(group, dim=1)  # [L + N, Hq, D]
    values = values.repeat_interleave(group, dim=1)
    allowed = torch.cat([torch.ones(n, context_len, dtype=torch.bool), ancestor_mask(parents)], dim=1).to(
        q.device
    )  # [N, L + N]
    scores = torch.einsum("nhd,thd->hnt", q.float(), keys) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))  # every row keeps at least itself
    out = torch.einsum("hnt,thd->nhd", torch.softmax(scores, dim=-1), values)
    return out.to(q.dtype)


def verify_pass_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    pass_mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The CPU path of one sequence's verify pass in an engine that has already written the
    pass's keys/values into the paged cache (vLLM does, before attention): ``out [R, Hq, D]``.

    The pass's ``R`` queries ``q [R, Hq, D]`` are the sequence's last ``R`` positions (the root,
    then the tree's nodes); keys/values of all ``seq_len`` positions are read from the cache views
    ``[num_blocks, Hkv, block_size, D]`` that ``layer.kv_layout.split`` gives (any strides). Every query sees
    the ``seq_len - R`` positions before the pass; among the pass's own, query ``r`` sees ``j``
    where ``pass_mask[r, j]`` (``[R, R]`` bool: the root's ancestor mask of the tree with the root
    as node 0, :meth:`.tree.DraftTree.with_root`). Same result as :func:`tree_attention` (its
    oracle; tests/unit/test_spec_tree_engine.py), computed without repeating kv heads per
    query head, in float32, as two batched matmuls over the kv heads with the keys gathered
    transposed (``[Hkv, D, S]``) and the scores scaled, and masked in place in the pass's own
    columns only (the context is never masked): at the tiny Llama's
    shapes (float32) this took 0.67-0.82x the time of matmul/softmax/matmul with keys ``[Hkv, S, D]``, and
    ``scaled_dot_product_attention`` (boolean mask, ``enable_gqa``) was no faster than that
    (benchmarks/tree_pass.py).
    """
    r, hq, d = q.shape
    _, hkv, bs, _ = k_cache.shape
    seq_len = int(seq_len)
    nb = -(-seq_len // bs)
    ids = block_table[:nb].long().to(k_cache.device)
    group = hq // hkv
    # keys as [Hkv, D, S] (a cpu_vec cache holds them so per block: the copy is a plain gather),
    # values as [Hkv, S, D]; float32 (no copy where the cache is float32 already)
    keys_t = k_cache.index_select(0, ids).permute(1, 3, 0, 2).reshape(hkv, d, nb * bs)[:, :, :seq_len].float()
    values = v_cache.index_select(0, ids).transpose(0, 1).reshape(hkv, nb * bs, d)[:, :seq_len].float()
    qg = q.float().view(r, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * r, d)  # [Hkv, g*R, D]
    scores = torch.bmm(qg, keys_t).mul_(scale).view(hkv, group, r, seq_len)  # [Hkv, g, R, S]
    # every row keeps the context, so only the pass's own columns are masked (7-10% of a pass
    # against masking every column, same output: docs/benchmarks/speculative.md, 2026-11-28)
    scores[..., seq_len - r :].masked_fill_(~pass_mask.to(q.device), float("-inf"))
    out = torch.bmm(torch.softmax(scores, dim=-1).view(hkv, group * r, seq_len), values)  # [Hkv, g*R, D]
    return out.view(hkv, group, r, d).permute(2, 0, 1, 3).reshape(r, hq, d).to(q.dtype)
