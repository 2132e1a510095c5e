"""The kit's attention exercise: ``plan`` then ``forward`` on paged batches (one prefill, ragged
decodes, a chunked-prefill continuation) over GQA shapes, checked against the kit's own float64
oracle (:func:`exact_attention`; with the attention mass, :func:`exact_attention_with_mass`, the
oracle of ``KVCompressor.attend`` and of the KV storage-format exercise): exactly for a lossless
plugin or one whose ``uses_host_kernel()`` is True, and for every plugin at the first position
of a sequence (one key: any causal attention returns its value).

Each case runs in every cache the plugin's ``kv_layouts`` claims (:func:`claimed_caches`): the
blocked layout, and for ``packed`` both physical orders vLLM's CUDA backends use (a logical
``[N, H_kv, B, 2D]`` view of ``[N, B, H_kv, 2D]``, and ``[N, H_kv, B, 2D]`` itself), the same
tokens written into each by ``KVCacheLayout.write``; the oracle reads through the layout's split.
A plugin that claims ``packed`` but reads the blocked memory order gets wrong numbers (or an
error) there and fails.
"""

from __future__ import annotations

from typing import Any

import dataclasses

from ....hooks import BLOCKED, CPU_VEC, KV_LAYOUTS, PACKED, AttentionLayer, KVCacheLayout, PagedBatch
from ..base import (
    Skipped,
    Target,
    max_err,
    tolerance,
    torch_dtype,
    torch_module,
)

ATTENTION_SHAPES = [  # (heads, kv heads, head size, block size)
    (4, 2, 64, 16),
    (4, 4, 128, 32),
    (8, 2, 64, 32),
]
#: Per sequence (tokens in the cache including the new ones, new tokens): one prefill,
#: decodes of ragged lengths, a chunked-prefill continuation.
ATTENTION_SEQS = [(7, 7), (40, 1), (19, 3), (33, 1)]


#: The caches a claimed layout is exercised in (a layout name -> the physical orders tried).
LAYOUT_CACHES = {"blocked": ("blocked",), "packed": ("packed-NHD", "packed-HND"), "cpu_vec": ("cpu_vec",)}


def claimed_caches(t: Target, impl: Any) -> list[str]:
    """The caches to exercise ``impl`` in: those of each layout its ``kv_layouts`` names."""
    names = getattr(impl, "kv_layouts", ("blocked",))
    if isinstance(names, str) or not names or any(n not in KV_LAYOUTS for n in names):
        raise t.fail(
            f"kv_layouts = {names!r}; it must be a non-empty tuple of layout names from "
            f"{sorted(KV_LAYOUTS)} (the layouts its reads of the cache handle)"
        )
    return [c for n in names for c in LAYOUT_CACHES[n]]


def relaid_cache(kv, cache: str) -> tuple[KVCacheLayout, Any]:
    """The keys and values of the blocked cache ``kv [N, H_kv, B, 2D]`` written by
    ``KVCacheLayout.write`` into a fresh (NaN-filled) cache ``cache`` (a name of
    :data:`LAYOUT_CACHES`); returns its layout and the logical ``[N, H_kv, B, 2D]`` view."""
    torch = torch_module()
    n, hkv, bs, c = kv.shape
    if cache == "blocked":
        return BLOCKED, kv
    if cache == "packed-NHD":
        out = torch.full((n, bs, hkv, c), float("nan"), dtype=kv.dtype).permute(0, 2, 1, 3)
    elif cache == "packed-HND":
        out = torch.full((n, hkv, bs, c), float("nan"), dtype=kv.dtype)
    elif cache == "cpu_vec":  # vLLM's CPU vec/vec16 cache: keys transposed per block and head
        out = torch.full((n, hkv, bs, c), float("nan"), dtype=kv.dtype)
    else:
        raise ValueError(f"unknown cache {cache!r}; expected one of {[x for v in LAYOUT_CACHES.values() for x in v]}")
    k, v = BLOCKED.split(kv)
    tokens = lambda x: x.permute(0, 2, 1, 3).reshape(n * bs, hkv, c // 2)  # noqa: E731  (slot order)
    layout = CPU_VEC if cache == "cpu_vec" else PACKED
    layout.write(tokens(k), tokens(v), out, torch.arange(n * bs))
    return layout, out


def attention_case(shape: tuple[int, int, int, int], dtype: str, seed: int, cache: str = "blocked"):
    """Queries, a paged cache (in ``cache``, see :func:`relaid_cache`; the same tokens for every
    cache), the batch and the layer (its ``kv_layout`` the cache's)."""
    torch = torch_module()
    h, hkv, d, bs = shape
    g = torch.Generator().manual_seed(seed)
    needed = [-(-n // bs) for n, _ in ATTENTION_SEQS]
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(needed) + 1
    table = torch.zeros(len(ATTENTION_SEQS), width, dtype=torch.int32)
    at = 0
    for i, k in enumerate(needed):
        table[i, :k] = torch.tensor(perm[at : at + k], dtype=torch.int32)
        # the unused tail points at real (other sequences') blocks: a method that reads
        # past seq_len gets wrong numbers, not zeros
        table[i, k:] = torch.tensor(perm[: width - k], dtype=torch.int32)
        at += k
    qsl = [0]
    for _, q in ATTENTION_SEQS:
        qsl.append(qsl[-1] + q)
    batch = PagedBatch(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([n for n, _ in ATTENTION_SEQS], dtype=torch.int32),
        block_table=table,
    )
    dt = torch_dtype(dtype)
    kv = torch.randn(num_blocks, hkv, bs, 2 * d, generator=g).to(dt)
    q = torch.randn(qsl[-1], h, d, generator=g).to(dt)
    layer = AttentionLayer(num_heads=h, num_kv_heads=hkv, head_size=d, scale=d**-0.5, block_size=bs)
    if cache != "blocked":
        layout, kv = relaid_cache(kv, cache)
        layer = dataclasses.replace(layer, kv_layout=layout)
    return q, kv, batch, layer


def exact_attention(q, kv, batch: PagedBatch, layer: AttentionLayer):
    """The kit's own oracle: token-by-token gather of the paged cache (through
    ``layer.kv_layout.split``), causal softmax in float64."""
    return exact_attention_with_mass(q, kv, batch, layer)[0]


def exact_attention_with_mass(q, kv, batch: PagedBatch, layer: AttentionLayer, observe=None, head_mask=None):
    """:func:`exact_attention` and the attention mass ``KVCompressor.attend`` reports, in float64:
    ``(out [T, H, D], mass)``. ``mass[i, j]`` is the softmax probability the queries of sequence
    ``i`` with ``observe[t]`` True put on the keys of block-table column ``j``, summed over heads
    and those queries (``None`` without ``observe``). With ``head_mask [num_seqs, H_kv,
    max_blocks]`` (bool) KV head ``h`` of sequence ``i`` reads only the columns where it is True
    (for its group of query heads), and ``mass`` is ``[num_seqs, H_kv, max_blocks]``, summed over
    the query heads of each KV head's group."""
    torch = torch_module()
    bs = layer.block_size
    parts = layer.kv_layout.split(kv)  # K, V [N, H_kv, B, D]
    group = layer.num_heads // layer.num_kv_heads

    def token(i: int, p: int, which: int):  # which 0: key, 1: value
        return parts[which][int(batch.block_table[i, p // bs]), :, p % bs]

    num_seqs, width = batch.block_table.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    mass = None
    if observe is not None:
        mass = torch.zeros(
            (num_seqs, layer.num_kv_heads, width) if head_mask is not None else (num_seqs, width), dtype=torch.float64
        )
    for i in range(num_seqs):
        n = int(batch.seq_lens[i])
        q0, q1 = int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1])
        if n <= 0 or q1 <= q0:
            continue
        keys = torch.stack([token(i, p, 0) for p in range(n)])
        vals = torch.stack([token(i, p, 1) for p in range(n)])
        keys, vals = keys.double(), vals.double()  # [n, Hkv, D]
        column = torch.arange(n) // bs  # the block-table column of each key
        for r in range(q1 - q0):
            pos = n - (q1 - q0) + r  # the query's own position: it sees keys 0..pos
            seen = observe is not None and bool(observe[q0 + r])
            for hh in range(layer.num_heads):
                kvh = hh // group
                s = keys[: pos + 1, kvh] @ q[q0 + r, hh].double() * layer.scale
                if head_mask is not None:
                    reads = head_mask[i, kvh].to(torch.bool)[column[: pos + 1]]
                    s = s.masked_fill(~reads, float("-inf"))
                p = torch.softmax(s, 0)
                out[q0 + r, hh] = p @ vals[: pos + 1, kvh]
                if seen:
                    assert mass is not None  # seen implies observe, which allocated mass
                    row = mass[i, kvh] if head_mask is not None else mass[i]
                    row.index_add_(0, column[: pos + 1], p)
    return out, mass


def _check_first_token(t: Target, out, q, kv, batch: PagedBatch, layer: AttentionLayer, dtype: str, label: str) -> None:
    """What any causal attention gives, lossy or not: a query at position 0 sees one key, its
    own, so its output is that token's value (softmax over one key is 1)."""
    exact = None
    for i in range(batch.seq_lens.numel()):
        n = int(batch.seq_lens[i])
        q0, q1 = int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1])
        if n != q1 - q0 or q1 <= q0:
            continue  # its queries do not start at position 0
        if exact is None:
            exact = exact_attention(q, kv, batch, layer)
        err = max_err(out[q0], exact[q0])
        if not err <= tolerance(dtype) * 10:
            raise t.fail(
                f"forward() gave the query at position 0 of sequence {i} an output {err:.3g} off "
                f"its own value ({label}); that query sees one key, its own, so any causal "
                "attention (lossy or not) returns that token's value there"
            )


def exercise_attention(t: Target, impl: Any, dtype: str, rules: bool) -> list[tuple[str, Any]]:
    results = []
    lossless = t.entry.registration.capabilities.lossless
    sizes = t.entry.registration.capabilities.head_sizes
    host = bool(impl.uses_host_kernel()) if rules else False
    caches = claimed_caches(t, impl)
    for j, shape in enumerate(ATTENTION_SHAPES):
        if sizes is not None and shape[2] not in sizes:
            continue
        for cache in caches:
            results.append(_attention_once(t, impl, shape, j, cache, dtype, rules, lossless, host))
    if not results:
        raise Skipped(f"declares head sizes {sizes}; the kit generates {sorted({s[2] for s in ATTENTION_SHAPES})}")
    return results


def call_in_cache(t: Target, cache: str, label: str, method: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``; an error in a cache other than the blocked one is reported as
    the plugin's claim of that layout failing."""
    if cache == "blocked":
        return fn(*args, **kwargs)
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported with the layout it claims
        raise t.fail(
            f"{method} raised {type(e).__name__}: {e} ({label}); kv_layouts claims "
            f"{cache.split('-')[0]!r}, so it must read the cache through "
            "layer.kv_layout.split(kv_cache), whatever the view's strides"
        ) from None


def _attention_once(
    t: Target, impl: Any, shape, j: int, cache: str, dtype: str, rules: bool, lossless: bool, host: bool
) -> tuple[str, Any]:
    torch = torch_module()
    q, kv, batch, layer = attention_case(shape, dtype, seed=100 + j, cache=cache)
    kv_before, q_before = kv.clone(), q.clone()
    label = f"H={shape[0]} Hkv={shape[1]} D={shape[2]} block={shape[3]} {dtype}"
    if cache != "blocked":
        label += f" {cache}"
    plan = impl.plan(batch)
    out = call_in_cache(t, cache, label, "forward()", impl.forward, q, kv, batch, layer, plan)
    if rules:
        if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype:
            raise t.fail(
                f"forward returned {getattr(out, 'shape', out)} "
                f"{getattr(out, 'dtype', '')} for query {tuple(q.shape)} {q.dtype} "
                f"({label}); it must return [T, H, D] in the query's dtype"
            )
        if not torch.isfinite(out).all():
            raise t.fail(f"forward returned non-finite values ({label})")
        if not (torch.equal(kv, kv_before) and torch.equal(q, q_before)):
            raise t.fail(f"forward modified its query or KV cache in place ({label})")
        if lossless or host:
            err = max_err(out, exact_attention(q, kv, batch, layer))
            if err > tolerance(dtype) * 10:
                why = (
                    "declared lossless"
                    if lossless
                    else "uses_host_kernel() is True (the host's kernel then replaces forward())"
                )
                raise t.fail(f"{why}, but forward() differs from exact causal attention by {err:.3g} ({label})")
            label += f" max|err| vs exact {err:.2e}"
        _check_first_token(t, out, q, kv, batch, layer, dtype, label)
    return label, out
