"""The kit's kvcompress exercises: an eviction compressor's ``keep()`` over growing views of
simulated requests, and a KV storage format (role ``storage``, :class:`KVCacheFormat`)
written and read back as vLLM does; :func:`exercise_kvcompress` dispatches formats to
:func:`exercise_kv_format`.
"""
from __future__ import annotations

import random
from typing import Any

from vllm_graft.hooks import BlockView, KVCacheFormat
from vllm_graft.hooks.contracts import split_kv_cache
from vllm_graft.integration.adapters.kvcompress.keep import (
    KeepError,
    check_keep,
    check_keep_heads,
    dropped_blocks,
    union_of_heads,
)
from vllm_graft.kit.conformance.base import Skipped, Target, torch_dtype, torch_module
from vllm_graft.kit.conformance.exercises.attention import (
    ATTENTION_SEQS,
    ATTENTION_SHAPES,
    attention_case,
    exact_attention,
)


def _kv_views(needs_scores: bool):
    """Per simulated request: the growing views an engine would show a compressor."""
    rnd = random.Random(7)
    for bs in (16, 32):
        for prompt in (5, 100, 700):
            seq = []
            scores_acc: list[float] = []
            for n in range(prompt, prompt + 240, 13):
                nb = -(-n // bs)
                while len(scores_acc) < nb:
                    scores_acc.append(rnd.random())
                scores = tuple(scores_acc[:nb]) if needs_scores else None
                seq.append(BlockView(num_tokens=n, block_size=bs, num_prompt_tokens=prompt, scores=scores))
            yield f"block={bs} prompt={prompt}", seq


def exercise_kvcompress(t: Target, impl: Any, dtype: str, rules: bool) -> list[tuple[str, Any]]:
    if isinstance(impl, KVCacheFormat):  # a storage format (role "storage") evicts nothing
        return exercise_kv_format(t, impl, dtype, rules)
    results = []
    lossless = t.entry.registration.capabilities.lossless
    deterministic = not getattr(impl, "needs_scores", False)
    name = t.entry.name
    def ask(view: BlockView) -> list[int]:
        try:
            return check_keep(view, impl.keep(view), name)
        except KeepError as e:
            raise t.fail(str(e)) from None

    for label, views in _kv_views(not deterministic):
        dropped: set[int] = set()
        answers = []
        for view in views:
            kept = ask(view)
            if rules:
                back = sorted(dropped & set(kept))
                if back:
                    raise t.fail(f"keep() keeps block(s) {back} it dropped earlier ({label}, "
                                 f"{view.num_tokens} tokens): dropped KV is gone")
                if deterministic and ask(view) != kept:
                    raise t.fail(f"keep() answered differently for the same view ({label})")
                if deterministic and view.num_blocks > 1:
                    pinned = frozenset({0})
                    pv = BlockView(view.num_tokens, view.block_size, view.num_prompt_tokens,
                                   view.scores, pinned)
                    got = ask(pv)
                    if got != sorted(set(kept) | pinned):
                        raise t.fail(f"with block 0 pinned keep() gave {got}, not its unpinned "
                                     f"answer plus the pinned block ({sorted(set(kept) | pinned)})")
                if lossless and len(kept) != view.num_blocks:
                    raise t.fail(f"declared lossless but dropped blocks "
                                 f"{dropped_blocks(view, kept)} ({label})")
            dropped |= set(dropped_blocks(view, kept))
            answers.append(kept)
        results.append((label, answers))
    if getattr(impl, "per_head", False):
        results += exercise_keep_heads(t, impl, rules)
    return results


def exercise_keep_heads(t: Target, impl: Any, rules: bool) -> list[tuple[str, Any]]:
    """A per-KV-head compressor (``per_head``): ``keep_heads()`` over growing views with
    ``head_scores`` for 2 KV heads (a block a head dropped shown ``-inf`` to it): one rule-abiding
    list per head, ``keep()`` their union, and a block a head dropped never comes back for it."""
    rnd = random.Random(8)
    results = []
    name = t.entry.name
    for label, views in _kv_views(True):
        dropped: list[set[int]] = [set(), set()]
        acc: list[list[float]] = [[], []]
        answers = []
        for view in views:
            for h in range(2):
                while len(acc[h]) < view.num_blocks:
                    acc[h].append(rnd.random() ** (1 + 3 * h))
            heads = tuple(tuple(float("-inf") if i in dropped[h] else acc[h][i] for i in range(view.num_blocks))
                          for h in range(2))
            hv = BlockView(view.num_tokens, view.block_size, view.num_prompt_tokens,
                           tuple(map(sum, zip(*heads))), head_scores=heads)
            try:
                kept = check_keep_heads(hv, impl.keep_heads(hv), name)
            except KeepError as e:
                raise t.fail(str(e)) from None
            if rules:
                for h in range(2):
                    back = sorted(dropped[h] & set(kept[h]))
                    if back:
                        raise t.fail(f"keep_heads() keeps block(s) {back} for KV head {h}, which that head "
                                     f"dropped earlier ({label}, {view.num_tokens} tokens)")
                union = check_keep(hv, impl.keep(hv), name)
                if union != union_of_heads(kept):
                    raise t.fail(f"keep() gave {union}, not the union of keep_heads() ({union_of_heads(kept)}) "
                                 f"({label}): a block is freed only when no head keeps it")
            for h in range(2):
                dropped[h] |= set(dropped_blocks(hv, kept[h]))
            answers.append(kept)
        results.append((f"per head {label}", answers))
    return results


#: A storage format is lossy by design; its attention must still be this close to exact
#: attention over the full-precision K/V it was given (relative Frobenius error): a format
#: that loses or misplaces tokens is far off (a 4-bit format is ~0.1 off).
FORMAT_REL_TOL = 0.25


def exercise_kv_format(t: Target, impl: Any, dtype: str, rules: bool) -> list[tuple[str, Any]]:
    """A :class:`~vllm_graft.hooks.KVCacheFormat`: pages of ``bytes_per_token``; the K/V of
    :data:`ATTENTION_SEQS` written as vLLM writes them (one call with every sequence's cached
    tokens and padding slots, then the new tokens one step at a time, interleaved across
    sequences) into scattered blocks; its attention compared with the kit's oracle over the
    full-precision K/V; the attention mass (``observe``) sums to one per query and head."""
    torch = torch_module()
    results = []
    for shape in ATTENTION_SHAPES:
        h, hkv, d, bs = shape
        if impl.unsupported(d, bs):
            continue
        label = f"format heads={h}/{hkv} head={d} block={bs} {dtype}"
        width = impl.bytes_per_token(d, bs)
        if not isinstance(width, int) or width <= 0:
            raise t.fail(f"bytes_per_token({d}, {bs}) returned {width!r}, not a positive int")
        q, dense, batch, layer = attention_case(shape, dtype, seed=11)
        dense.zero_()
        cache = torch.zeros(dense.shape[0], hkv, bs, width, dtype=torch.uint8)
        g = torch.Generator().manual_seed(12)
        k_dense, v_dense = split_kv_cache(dense)
        kv = []
        for i, (n, _) in enumerate(ATTENTION_SEQS):
            k = torch.randn(n, hkv, d, generator=g).to(torch_dtype(dtype))
            v = torch.randn(n, hkv, d, generator=g).to(torch_dtype(dtype))
            slots = batch.block_table[i, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
            k_dense[slots // bs, :, slots % bs] = k
            v_dense[slots // bs, :, slots % bs] = v
            kv.append((k, v, slots))
        # step 0: every sequence's cached tokens, with padding slots between them
        parts = [(k[:n - qn], v[:n - qn], s[:n - qn]) for (k, v, s), (n, qn) in zip(kv, ATTENTION_SEQS)]
        pad = (torch.zeros(2, hkv, d, dtype=torch_dtype(dtype)), torch.zeros(2, hkv, d, dtype=torch_dtype(dtype)),
               torch.full((2,), -1, dtype=torch.long))
        parts = [x for p in parts for x in (p, pad)]
        impl.write(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), cache,
                   torch.cat([p[2] for p in parts]))
        for step in range(max(qn for _, qn in ATTENTION_SEQS)):  # then one new token per step
            rows = [(k[n - qn + step:n - qn + step + 1], v[n - qn + step:n - qn + step + 1],
                     s[n - qn + step:n - qn + step + 1])
                    for (k, v, s), (n, qn) in zip(kv, ATTENTION_SEQS) if step < qn]
            impl.write(torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows]), cache,
                       torch.cat([r[2] for r in rows]))
        out, mass = impl.forward(q, cache, batch, layer, None)
        if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype:
            raise t.fail(f"forward returned {tuple(out.shape)} {out.dtype}, expected {tuple(q.shape)} {q.dtype}")
        exact = exact_attention(q, dense, batch, layer).float()
        rel = ((out.float() - exact).norm() / exact.norm()).item()
        if rules and not rel <= FORMAT_REL_TOL:
            raise t.fail(f"its attention over what write() stored is {rel:.3f} off exact attention over "
                         f"the K/V it was given (relative error; at most {FORMAT_REL_TOL}) ({label}): "
                         "write() loses or misplaces tokens, or forward() misreads the page")
        if rules:
            observe = torch.ones(q.shape[0], dtype=torch.bool)
            out2, mass = impl.forward(q, cache, batch, layer, observe)
            if mass is None or tuple(mass.shape) != tuple(batch.block_table.shape):
                raise t.fail(f"forward(observe=...) returned mass {getattr(mass, 'shape', mass)}, expected "
                             f"{tuple(batch.block_table.shape)} (an eviction compressor that needs scores reads it)")
            qs = torch.tensor([qn for _, qn in ATTENTION_SEQS], dtype=torch.float32) * h
            if (mass.sum(1).float() - qs).abs().max() > 1e-2 * qs.max():
                raise t.fail(f"attention mass per sequence sums to {mass.sum(1).tolist()}, expected "
                             f"{qs.tolist()} (one per observed query and head)")
        results.append((label, out))
        print(f"{t.spec} {label}: {width} bytes/token/head (dense fp16 {4 * d}), "
              f"attention {rel:.3f} off exact (relative)")
    if not results:
        raise Skipped(f"supports none of the kit's (head size, block size) shapes "
                      f"{[(s[2], s[3]) for s in ATTENTION_SHAPES]}")
    return results
