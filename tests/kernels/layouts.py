"""The same paged K/V in the three caches a plugin may be handed (``layer.kv_layout`` and the
view's physical order), for the layout tests of kernels and references:

* ``blocked``: vLLM's CPU layout, ``[N, H_kv, B, 2D]`` with per block and KV head the keys, then
  the values;
* ``packed-NHD``: K|V side by side per token, physically ``[N, B, H_kv, 2D]`` viewed as the
  logical ``[N, H_kv, B, 2D]`` (vLLM's CUDA default);
* ``packed-HND``: K|V side by side per token, physically ``[N, H_kv, B, 2D]``.

Each is filled by :meth:`KVCacheLayout.write` from the same tokens."""
from __future__ import annotations

import dataclasses

import torch

from vllm_graft.hooks import BLOCKED, PACKED, AttentionLayer, KVCacheLayout

CACHES = ("blocked", "packed-NHD", "packed-HND")


def empty_cache(name: str, n: int, hkv: int, bs: int, c: int, dtype, device) -> tuple[KVCacheLayout, torch.Tensor]:
    """A NaN-filled (zero for integers) logical ``[n, hkv, bs, c]`` cache of ``name`` and its layout."""
    if name not in CACHES:
        raise ValueError(f"unknown cache {name!r}; expected one of {CACHES}")
    fill = float("nan") if dtype.is_floating_point else 0
    if name == "packed-NHD":
        return PACKED, torch.full((n, bs, hkv, c), fill, dtype=dtype, device=device).permute(0, 2, 1, 3)
    return (BLOCKED if name == "blocked" else PACKED), torch.full((n, hkv, bs, c), fill, dtype=dtype, device=device)


def relaid(kv: torch.Tensor, name: str) -> tuple[KVCacheLayout, torch.Tensor]:
    """The keys and values of the blocked cache ``kv [N, H_kv, B, 2D]``, every slot written with
    ``KVCacheLayout.write`` into a cache of ``name``; returns its layout and the cache."""
    n, hkv, bs, c = kv.shape
    k, v = BLOCKED.split(kv)
    key = k.permute(0, 2, 1, 3).reshape(n * bs, hkv, c // 2)  # slot = block * bs + offset
    value = v.permute(0, 2, 1, 3).reshape(n * bs, hkv, c // 2)
    layout, cache = empty_cache(name, n, hkv, bs, c, kv.dtype, kv.device)
    layout.write(key, value, cache, torch.arange(n * bs, device=kv.device))
    return layout, cache


def in_cache(kv: torch.Tensor, layer: AttentionLayer, name: str) -> tuple[torch.Tensor, AttentionLayer]:
    """``(cache, layer)`` of :func:`relaid`, the layer carrying the cache's layout."""
    layout, cache = relaid(kv, name)
    return cache, dataclasses.replace(layer, kv_layout=layout)
