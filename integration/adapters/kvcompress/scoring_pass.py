"""Scoring passes (``KVCompressor.scoring_pass`` compressors, e.g. KVzip), vLLM-free: the
metadata a layer's attention sees during a pass and the paged scoring attention it runs.

A pass is the model's own forward over tokens fed after a request's context (see
:mod:`.scoring_forward`, which runs it). Every attention layer gets a :class:`PassMetadata` in
place of vLLM's metadata, and the graft backends (CPU, CUDA, generic) hand it to
:func:`pass_forward` instead of their kernel: the pass's queries attend over the request's
context KV, read from the paged cache by its block ids, and causally over the pass's own K/V,
which stay in local tensors (no slot mapping reaches ``do_kv_cache_update``: nothing is written,
no block is allocated). The per-pair score, the largest softmax probability that an observed
query puts on each context token (over the query heads of each KV head's group), is folded into
``PassMetadata.pair`` by layer index, as a max over the passes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ....hooks import AttentionLayer

#: query rows per tile: bounds the probabilities held at once to ``H x TILE x (N + n)`` floats
TILE = 256


@dataclass
class PassMetadata:
    """What every attention layer sees during a scoring pass of one request."""

    #: the request's KV-cache blocks holding its context, in order (the manager's block ids)
    block_ids: torch.Tensor
    #: the KV-cache manager's block size (a kernel block may be smaller: see :func:`kernel_blocks`)
    block_size: int
    context_len: int
    #: the pass's query rows from which on queries score
    observe_from: int = 0
    #: layer index -> ``[H_kv, context_len]`` float32 pair scores (max over the passes so far)
    pair: dict[int, torch.Tensor] = field(default_factory=dict)
    #: how many layers ran the pass (the backends count it)
    layers: int = 0
    # vLLM's attention metadata fields some code reads off any metadata
    num_actual_tokens: int = 0


def kernel_blocks(block_ids: torch.Tensor, manager_block: int, kernel_block: int) -> torch.Tensor:
    """The kernel's block ids of manager blocks ``block_ids`` (vLLM splits each manager block
    into ``manager_block // kernel_block`` kernel blocks, numbered consecutively)."""
    if manager_block == kernel_block:
        return block_ids
    if manager_block % kernel_block:
        raise ValueError(f"KV-cache block size {manager_block} is not a multiple of the kernel's {kernel_block}")
    per = manager_block // kernel_block
    sub = torch.arange(per, device=block_ids.device, dtype=block_ids.dtype)
    return (block_ids[:, None] * per + sub[None, :]).reshape(-1)


def context_kv(kv_cache: torch.Tensor, meta: PassMetadata, layer: AttentionLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """The request's context keys and values ``[H_kv, context_len, D]`` from the paged cache (in
    the layer's layout), gathered by block id."""
    key_cache, value_cache = layer.kv_layout.split(kv_cache)  # [N, H_kv, B, D] views
    B = key_cache.shape[2]
    blocks = kernel_blocks(meta.block_ids.to(kv_cache.device).long(), meta.block_size, B)
    blocks = blocks[: -(-meta.context_len // B)]
    hkv, D = key_cache.shape[1], key_cache.shape[3]
    k = key_cache[blocks].permute(1, 0, 2, 3).reshape(hkv, -1, D)[:, : meta.context_len]
    v = value_cache[blocks].permute(1, 0, 2, 3).reshape(hkv, -1, D)[:, : meta.context_len]
    return k, v


def pass_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PassMetadata,
    layer: AttentionLayer,
    tile: int = TILE,
) -> torch.Tensor:
    """One layer of a scoring pass: ``query [n, H, D]``, the pass's ``key``/``value [n, H_kv, D]``
    (positions applied). Returns the attention output ``[n, H, D]`` (the query's dtype) and folds
    this layer's pair scores into ``meta.pair[layer.index]``. Exact, float32; tiled over the
    query rows. No host sync."""
    n, H, D = query.shape
    ck, cv = context_kv(kv_cache, meta, layer)
    hkv, N = ck.shape[0], ck.shape[1]
    G = H // hkv
    kT = torch.cat([ck.float(), key[:n].float().transpose(0, 1)], dim=1).transpose(1, 2)[:, None]  # [H_kv, 1, D, N+n]
    v = torch.cat([cv.float(), value[:n].float().transpose(0, 1)], dim=1)[:, None]  # [H_kv, 1, N + n, D]
    q = query.float().view(n, hkv, G, D).permute(1, 2, 0, 3) * float(layer.scale)  # [H_kv, G, n, D]
    out = torch.empty(hkv, G, n, D, dtype=torch.float32, device=query.device)
    pair = torch.zeros(hkv, N, dtype=torch.float32, device=query.device)
    own = torch.arange(n, device=query.device)
    for t0 in range(0, n, tile):
        t1 = min(n, t0 + tile)
        logits = torch.matmul(q[:, :, t0:t1], kT)  # [H_kv, G, tt, N + n]
        # the pass's own keys after each query: masked (the context's keys are all visible)
        logits[..., N:].masked_fill_(own[None, :] > own[t0:t1, None], float("-inf"))
        prob = torch.softmax(logits, dim=-1)
        out[:, :, t0:t1] = torch.matmul(prob, v)
        first = max(meta.observe_from, t0) - t0
        if first < t1 - t0:
            pair = torch.maximum(pair, prob[:, :, first:, :N].amax(dim=(1, 2)))
    index = int(layer.index)
    if index < 0:
        raise NotImplementedError(
            "vllm-graft kvcompress scoring pass: the attention route gave no decoder layer index "
            "(AttentionLayer.index); use a route that sets it"
        )
    old = meta.pair.get(index)
    meta.pair[index] = pair if old is None else torch.maximum(old, pair)
    meta.layers += 1
    return out.permute(2, 0, 1, 3).reshape(n, H, D).to(query.dtype)


def stacked(meta: PassMetadata) -> torch.Tensor | None:
    """``[layers, H_kv, context_len]``: the pair scores by layer index (None: no layer ran)."""
    if not meta.pair:
        return None
    return torch.stack([meta.pair[i] for i in sorted(meta.pair)])


def run_in_backend(layer_spec: AttentionLayer, query, key, value, kv_cache, meta, output) -> Any:
    """A backend impl's ``forward`` during a scoring pass: :func:`pass_forward` into ``output``."""
    n = query.shape[0]
    q = query.view(n, layer_spec.num_heads, layer_spec.head_size)
    k = key.view(n, layer_spec.num_kv_heads, layer_spec.head_size)
    v = value.view(n, layer_spec.num_kv_heads, layer_spec.head_size)
    out = pass_forward(q, k, v, kv_cache, meta, layer_spec)
    output[:n].view(n, layer_spec.num_heads, layer_spec.head_size).copy_(out.to(output.dtype))
    return output
