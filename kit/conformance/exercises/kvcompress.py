"""The kit's kvcompress exercises: an eviction compressor's ``keep()`` (and ``keep_heads()``)
over growing views of simulated requests; a scored compressor's ``score_positions()`` and its
``attend()`` on ragged paged GQA batches against the kit's own float64 attention and mass
(:func:`~.attention.exact_attention_with_mass`); and a KV storage format (role ``storage``,
:class:`KVCacheFormat`) written and read back as vLLM does, its attention and mass against the
same oracle. :func:`exercise_kvcompress` dispatches formats to :func:`exercise_kv_format`.
"""

from __future__ import annotations

import functools
import random
from types import SimpleNamespace
from typing import Any

from ....hooks import (
    BlockView,
    KeepError,
    KVCacheFormat,
    check_keep,
    check_keep_heads,
    check_keep_layers,
    dropped_blocks,
    union_of_heads,
)
from ....hooks.contracts import split_kv_cache
from ..base import (
    Skipped,
    Target,
    max_err,
    tolerance,
    torch_dtype,
    torch_module,
)
from .attention import (
    ATTENTION_SEQS,
    ATTENTION_SHAPES,
    attention_case,
    call_in_cache,
    claimed_caches,
    exact_attention,
    exact_attention_with_mass,
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
                seq.append(
                    BlockView(
                        num_tokens=n,
                        block_size=bs,
                        num_prompt_tokens=prompt,
                        scores=scores,
                        request_id=f"kit-{bs}-{prompt}",
                    )
                )
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
                    raise t.fail(
                        f"keep() keeps block(s) {back} it dropped earlier ({label}, "
                        f"{view.num_tokens} tokens): dropped KV is gone"
                    )
                if deterministic and ask(view) != kept:
                    raise t.fail(f"keep() answered differently for the same view ({label})")
                if deterministic and view.num_blocks > 1:
                    pinned = frozenset({0})
                    pv = BlockView(view.num_tokens, view.block_size, view.num_prompt_tokens, view.scores, pinned)
                    got = ask(pv)
                    if got != sorted(set(kept) | pinned):
                        raise t.fail(
                            f"with block 0 pinned keep() gave {got}, not its unpinned "
                            f"answer plus the pinned block ({sorted(set(kept) | pinned)})"
                        )
                if lossless and len(kept) != view.num_blocks:
                    raise t.fail(f"declared lossless but dropped blocks {dropped_blocks(view, kept)} ({label})")
            dropped |= set(dropped_blocks(view, kept))
            answers.append(kept)
        results.append((label, answers))
    if getattr(impl, "per_head", False):
        results += exercise_keep_heads(t, impl, rules)
    if getattr(impl, "per_layer", False):
        results += exercise_keep_layers(t, impl, rules)
    if getattr(impl, "needs_scores", False):
        if rules:
            check_score_positions(t, impl)
        results += exercise_attend(t, impl, dtype, rules)
        results += exercise_block_scores(t, impl, dtype)
    if getattr(impl, "scoring_pass", False):
        results += exercise_scoring_passes(t, impl)
    if getattr(impl, "merges", False):
        results += exercise_merge(t, impl, dtype)
    return results


def exercise_scoring_passes(t: Target, impl: Any) -> list[tuple[str, Any]]:
    """A compressor with scoring passes (``scoring_pass``): ``scoring_passes`` gives
    :class:`~vllm_graft.hooks.ScoringPass` es of int token ids with ``observe_from`` in range, the
    same for the same prompt; ``pass_block_scores`` turns pair scores ``[L, H_kv, N]`` into one
    finite score per block, on the input's device, leaving the input unmodified."""
    from ....hooks import ScoringPass

    torch = torch_module()
    out = []
    for n in (1, 37, 700):
        prompt = [(7 * i) % 1000 + 3 for i in range(n)]

        def tokenize(text: str) -> list[int]:
            return [ord(c) % 1000 for c in text][:12] or [1]

        passes = list(impl.scoring_passes(prompt, tokenize))
        if list(impl.scoring_passes(prompt, tokenize)) != passes:
            raise t.fail(f"scoring_passes() answered differently for the same {n}-token prompt")
        for p in passes:
            if not isinstance(p, ScoringPass):
                raise t.fail(f"scoring_passes() returned {type(p).__name__}, not vllm_graft.hooks.ScoringPass")
            ids = list(p.token_ids)
            if not ids or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids):
                raise t.fail(f"a scoring pass's token_ids must be non-empty non-negative ints, got {ids[:8]}...")
            if not 0 <= p.observe_from < len(ids):
                raise t.fail(f"observe_from {p.observe_from} is outside the pass's {len(ids)} tokens")
        g = torch.Generator().manual_seed(n)
        pair = torch.rand(2, 2, n, generator=g)
        before = pair.clone()
        for bs in (16, 32):
            got = impl.pass_block_scores(pair, bs)
            nb = -(-n // bs)
            if tuple(got.shape) != (nb,) or not bool(torch.isfinite(got).all()):
                raise t.fail(
                    f"pass_block_scores() for {n} tokens in blocks of {bs} gave {tuple(got.shape)}, "
                    f"expected {nb} finite scores"
                )
            if got.device != pair.device:
                raise t.fail("pass_block_scores() answered on another device than its input's")
        if not torch.equal(pair, before):
            raise t.fail("pass_block_scores() modified its input")
        out.append((f"scoring passes, prompt {n}", [len(p.token_ids) for p in passes]))
    return out


def exercise_merge(t: Target, impl: Any, dtype: str) -> list[tuple[str, Any]]:
    """A merge-on-evict compressor (``merges``): ``merge()`` on dropped and kept K/V (some dropped
    keys near kept ones) answers kept K/V of the inputs' shape and dtype, finite, the same for the
    same inputs, and takes back the state it returned (a second eviction of the same request)."""
    torch = torch_module()
    dt = torch_dtype(dtype)
    results = []
    for H, E, M, D in ((2, 16, 48, 64), (1, 32, 17, 128)):
        g = torch.Generator().manual_seed(H * 1000 + M)
        kept_k, kept_v = torch.randn(H, M, D, generator=g), torch.randn(H, M, D, generator=g)
        near = kept_k[:, torch.randint(0, M, (E,), generator=g)]
        dropped_k = (near + 0.3 * torch.randn(H, E, D, generator=g)).to(dt)
        dropped_v = torch.randn(H, E, D, generator=g).to(dt)
        kept_k, kept_v = kept_k.to(dt), kept_v.to(dt)
        label = f"merge H={H} E={E} M={M} D={D} {dtype}"
        answers = []
        state = None
        for step in range(2):
            args = [x.clone() for x in (dropped_k, dropped_v, kept_k, kept_v)]
            try:
                out = impl.merge(*args, state)
            except Exception as e:  # noqa: BLE001 - reported with the plugin's name
                raise t.fail(f"merge() raised {type(e).__name__}: {e} ({label})") from None
            if not (isinstance(out, tuple) and len(out) == 3):
                raise t.fail(f"merge() must return (kept_k, kept_v, state), got {type(out).__name__} ({label})")
            for name, got, like in (("kept_k", out[0], kept_k), ("kept_v", out[1], kept_v)):
                if not isinstance(got, torch.Tensor) or got.shape != like.shape or got.dtype != like.dtype:
                    raise t.fail(
                        f"merge() returned {name} {getattr(got, 'shape', got)} {getattr(got, 'dtype', '')}; "
                        f"expected {tuple(like.shape)} {like.dtype} ({label})"
                    )
                if not torch.isfinite(got.float()).all():
                    raise t.fail(f"merge() returned non-finite {name} ({label})")
            again = impl.merge(*[x.clone() for x in (dropped_k, dropped_v, kept_k, kept_v)], state)
            if not (torch.equal(again[0], out[0]) and torch.equal(again[1], out[1])):
                raise t.fail(f"merge() answered differently for the same inputs and state ({label})")
            answers += [out[0].float(), out[1].float()]
            state = out[2]
            kept_k, kept_v = out[0], out[1]
        results.append((label, answers))
    return results


def exercise_block_scores(t: Target, impl: Any, dtype: str) -> list[tuple[str, Any]]:
    """A compressor scoring blocks from the cache (``block_scores``) on the attention
    exercise's paged batches: a floating ``[num_seqs, max_blocks]`` tensor, finite on every
    sequence's blocks, its inputs left as they were, and the same scores for the same tokens in
    every cache layout it claims (the first, blocked, is the reference)."""
    from ....integration.adapters.kvcompress.shared_attention import (
        attend_with_mass,
        block_scores,
        layouts_read,
        scores_the_cache,
    )

    if not scores_the_cache(impl):
        return []
    torch = torch_module()
    sizes = t.entry.registration.capabilities.head_sizes
    caches = claimed_caches(t, SimpleNamespace(kv_layouts=layouts_read(impl)))
    results = []
    for j, shape in enumerate(ATTENTION_SHAPES):
        if sizes is not None and shape[2] not in sizes:
            continue
        want = None
        for cache in caches:
            q, kv, batch, layer = attention_case(shape, dtype, seed=400 + j, cache=cache)
            label = f"block_scores H={shape[0]} Hkv={shape[1]} D={shape[2]} block={shape[3]} {dtype} {cache}"
            before = kv.clone()
            observe = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
            _, mass = attend_with_mass(impl, q, kv, batch, layer, observe)  # as the worker hands it over
            got = call_in_cache(
                t, cache, label, "block_scores()", block_scores, impl, kv, batch, layer, q, observe, mass
            )
            S, W = batch.block_table.shape
            if not isinstance(got, torch.Tensor) or tuple(got.shape) != (S, W) or not got.is_floating_point():
                raise t.fail(
                    f"block_scores() returned {getattr(got, 'shape', got)} {getattr(got, 'dtype', '')} "
                    f"({label}); it must be a floating tensor [num_seqs, max_blocks] = {[S, W]}"
                )
            lens = batch.seq_lens.cpu().long()  # checked on the host
            used = torch.arange(W, device=lens.device)[None, :] * shape[3] < lens[:, None]
            host = got.float().cpu()
            if not torch.isfinite(host[used]).all():
                raise t.fail(f"block_scores() returned non-finite scores for a sequence's blocks ({label})")
            if not torch.equal(kv, before):
                raise t.fail(f"block_scores() modified the KV cache in place ({label})")
            got = torch.where(used, host, torch.zeros((), device=lens.device))
            if want is None:
                want = got
            elif not max_err(got, want) <= tolerance(dtype):
                raise t.fail(
                    f"block_scores() differs by {max_err(got, want):.3g} from the blocked cache's for the "
                    f"same tokens ({label}); read the cache through layer.kv_layout.split"
                )
            results.append((label, got))
    return results


def check_score_positions(t: Target, impl: Any) -> None:
    """``score_positions(num_prompt_tokens)``: ``(start, end)`` ints with ``0 <= start <= end``,
    not empty for every prompt length (the scores would then stay zero)."""
    ranges = []
    for prompt in (1, 5, 100, 700):
        got = impl.score_positions(prompt)
        try:
            start, end = got
            ok = all(isinstance(x, int) and not isinstance(x, bool) for x in (start, end)) and 0 <= start <= end
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise t.fail(
                f"score_positions({prompt}) returned {got!r}; it must return (start, end), two "
                "ints with 0 <= start <= end (token positions whose queries' attention is scored)"
            )
        ranges.append((start, end))
    if all(a == b for a, b in ranges) and not getattr(impl, "scoring_pass", False):  # passes score it
        raise t.fail(
            f"score_positions() is empty for every prompt length tried ({ranges}): no query's "
            "attention would ever count, so every score stays 0"
        )


def _observed(num_rows: int):
    """The queries whose mass counts in the attend exercise: a fixed mix (a decode sequence
    with none observed, a prefill and a chunk with some)."""
    torch = torch_module()
    return torch.tensor([r % 3 != 1 for r in range(num_rows)], dtype=torch.bool)


def _head_mask(batch, hkv: int, bs: int, seed: int):
    """A per-KV-head block mask ``[num_seqs, H_kv, max_blocks]``: random, with the last block
    of each sequence read by every head (the one being written, always kept)."""
    torch = torch_module()
    g = torch.Generator().manual_seed(seed)
    num_seqs, width = batch.block_table.shape
    mask = torch.rand(num_seqs, hkv, width, generator=g) < 0.6
    for i in range(num_seqs):
        last = (int(batch.seq_lens[i]) - 1) // bs
        mask[i, :, last] = True
    return mask


def exercise_attend(t: Target, impl: Any, dtype: str, rules: bool) -> list[tuple[str, Any]]:
    """A scored compressor's ``attend()`` (``needs_scores``) on the attention exercise's paged
    batches (one prefill, ragged decodes, a chunked-prefill continuation; GQA and MHA; head
    sizes 64 and 128; blocks of 16 and 32; the block table's unused tail pointing at other
    sequences' blocks), with a mix of observed queries; per KV head with a random ``head_mask``
    for a ``per_head`` compressor. Output and mass are compared with the kit's float64
    computation (:func:`~.attention.exact_attention_with_mass`), in every cache its
    ``kv_layouts`` claims (:func:`~.attention.claimed_caches`)."""
    from ....integration.adapters.kvcompress.shared_attention import attend_with_mass, layouts_read

    per_head = bool(getattr(impl, "per_head", False))
    sizes = t.entry.registration.capabilities.head_sizes
    results = []
    # what the worker runs: the plugin's own attend, or the shared attention with mass
    caches = claimed_caches(t, SimpleNamespace(kv_layouts=layouts_read(impl)))
    attend = functools.partial(attend_with_mass, impl)
    for j, shape in enumerate(ATTENTION_SHAPES):
        h, hkv, d, bs = shape
        if sizes is not None and d not in sizes:
            continue
        for cache in caches:
            results.append(_attend_once(t, attend, shape, j, cache, dtype, rules, per_head))
    return results


def _attend_once(
    t: Target, attend: Any, shape, j: int, cache: str, dtype: str, rules: bool, per_head: bool
) -> tuple[str, Any]:
    torch = torch_module()
    h, hkv, d, bs = shape
    q, kv, batch, layer = attention_case(shape, dtype, seed=200 + j, cache=cache)
    observe = _observed(q.shape[0])
    head_mask = _head_mask(batch, hkv, bs, seed=210 + j) if per_head else None
    label = f"attend H={h} Hkv={hkv} D={d} block={bs} {dtype}" + (" per KV head" if per_head else "")
    if cache != "blocked":
        label += f" {cache}"
    before = [x.clone() for x in (q, kv, observe)]
    if head_mask is not None:  # per_head
        got = call_in_cache(
            t, cache, label, "attend()", attend, q, kv, batch, layer, observe, head_mask=head_mask.clone()
        )
    else:
        got = call_in_cache(t, cache, label, "attend()", attend, q, kv, batch, layer, observe)
    try:
        out, mass = got
    except (TypeError, ValueError):
        raise t.fail(
            f"attend() returned {type(got).__name__}; it must return (out [T, H, D], mass) ({label})"
        ) from None
    if rules:
        want_mass = (
            (batch.block_table.shape[0], hkv, batch.block_table.shape[1])
            if per_head
            else tuple(batch.block_table.shape)
        )
        if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype:
            raise t.fail(
                f"attend() returned out {getattr(out, 'shape', out)} {getattr(out, 'dtype', '')} "
                f"for query {tuple(q.shape)} {q.dtype} ({label}); it must be [T, H, D] in "
                "the query's dtype"
            )
        if not isinstance(mass, torch.Tensor) or tuple(mass.shape) != want_mass or not mass.is_floating_point():
            raise t.fail(
                f"attend() returned mass {getattr(mass, 'shape', mass)} "
                f"{getattr(mass, 'dtype', '')} ({label}); it must be a floating tensor "
                + (
                    f"[num_seqs, H_kv, max_blocks] = {list(want_mass)} (per KV head, with head_mask)"
                    if per_head
                    else f"[num_seqs, max_blocks] = {list(want_mass)}"
                )
            )
        if not (torch.isfinite(out).all() and torch.isfinite(mass.float()).all()):
            raise t.fail(f"attend() returned non-finite values ({label})")
        if not all(torch.equal(a, b) for a, b in zip((q, kv, observe), before)):
            raise t.fail(f"attend() modified its query, KV cache or observe in place ({label})")
        exact, exact_mass = exact_attention_with_mass(q, kv, batch, layer, observe, head_mask)
        err = max_err(out, exact)
        if not err <= tolerance(dtype) * 10:
            raise t.fail(
                f"attend() output differs from exact causal attention over the paged batch "
                f"{'(each KV head masked to its head_mask blocks) ' if per_head else ''}by "
                f"{err:.3g} ({label}); it must compute the layer's attention as "
                "AttentionMethod.forward does"
            )
        merr = max_err(mass, exact_mass)
        if not merr <= tolerance(dtype) * 10:
            diff = (mass.double() - exact_mass).abs()
            at = tuple(int(x) for x in (diff == diff.max()).nonzero()[0])
            raise t.fail(
                f"attend() mass differs from the kit's exact computation by {merr:.3g} at mass{list(at)}: "
                f"got {mass[at].item():.4g}, expected {exact_mass[at].item():.4g} ({label}); mass must be "
                "the softmax probability the observed queries (observe[t] True) put on the keys of each "
                "block-table column, summed over "
                + ("the query heads of each KV head" if per_head else "heads")
                + " and those queries (got per sequence "
                f"{[round(x, 3) for x in mass.double().flatten(1).sum(1).tolist()]}, expected "
                f"{[round(x, 3) for x in exact_mass.flatten(1).sum(1).tolist()]})"
            )
        label += f" max|err| out {err:.2e} mass {merr:.2e}"
    return label, (out, mass)


def exercise_keep_heads(t: Target, impl: Any, rules: bool) -> list[tuple[str, Any]]:
    """A per-KV-head compressor (``per_head``): ``keep_heads()`` over growing views with
    ``head_scores`` for 2 KV heads (a block a head dropped shown ``-inf`` to it): one rule-abiding
    list per head, ``keep()`` their union, and a block a head dropped never comes back for it."""
    return _exercise_per_unit(t, impl, rules, "head")


def exercise_keep_layers(t: Target, impl: Any, rules: bool) -> list[tuple[str, Any]]:
    """A per-layer compressor (``per_layer``): as :func:`exercise_keep_heads`, with ``keep_layers()``
    and ``layer_scores`` for 3 decoder layers."""
    return _exercise_per_unit(t, impl, rules, "layer")


def _exercise_per_unit(t: Target, impl: Any, rules: bool, unit: str) -> list[tuple[str, Any]]:
    rnd = random.Random(8)
    results = []
    name = t.entry.name
    units, method, check, what = (
        (2, "keep_heads", check_keep_heads, "KV head")
        if unit == "head"
        else (3, "keep_layers", check_keep_layers, "layer")
    )
    for label, views in _kv_views(True):
        dropped: list[set[int]] = [set() for _ in range(units)]
        acc: list[list[float]] = [[] for _ in range(units)]
        answers = []
        for view in views:
            for h in range(units):
                while len(acc[h]) < view.num_blocks:
                    acc[h].append(rnd.random() ** (1 + 3 * h))
            per_unit = tuple(
                tuple(float("-inf") if i in dropped[h] else acc[h][i] for i in range(view.num_blocks))
                for h in range(units)
            )
            hv = BlockView(
                view.num_tokens,
                view.block_size,
                view.num_prompt_tokens,
                tuple(map(sum, zip(*per_unit))),
                head_scores=per_unit if unit == "head" else None,
                layer_scores=per_unit if unit == "layer" else None,
            )
            try:
                kept = check(hv, getattr(impl, method)(hv), name)
            except KeepError as e:
                raise t.fail(str(e)) from None
            if rules:
                for h in range(units):
                    back = sorted(dropped[h] & set(kept[h]))
                    if back:
                        raise t.fail(
                            f"{method}() keeps block(s) {back} for {what} {h}, which that {unit} "
                            f"dropped earlier ({label}, {view.num_tokens} tokens)"
                        )
                union = check_keep(hv, impl.keep(hv), name)
                if union != union_of_heads(kept):
                    raise t.fail(
                        f"keep() gave {union}, not the union of {method}() ({union_of_heads(kept)}) "
                        f"({label}): a block is freed only when no {unit} keeps it"
                    )
            for h in range(units):
                dropped[h] |= set(dropped_blocks(hv, kept[h]))
            answers.append(kept)
        results.append((f"per {unit} {label}", answers))
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
        parts = [(k[: n - qn], v[: n - qn], s[: n - qn]) for (k, v, s), (n, qn) in zip(kv, ATTENTION_SEQS)]
        pad = (
            torch.zeros(2, hkv, d, dtype=torch_dtype(dtype)),
            torch.zeros(2, hkv, d, dtype=torch_dtype(dtype)),
            torch.full((2,), -1, dtype=torch.long),
        )
        parts = [x for p in parts for x in (p, pad)]
        impl.write(
            torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), cache, torch.cat([p[2] for p in parts])
        )
        for step in range(max(qn for _, qn in ATTENTION_SEQS)):  # then one new token per step
            rows = [
                (
                    k[n - qn + step : n - qn + step + 1],
                    v[n - qn + step : n - qn + step + 1],
                    s[n - qn + step : n - qn + step + 1],
                )
                for (k, v, s), (n, qn) in zip(kv, ATTENTION_SEQS)
                if step < qn
            ]
            impl.write(
                torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows]), cache, torch.cat([r[2] for r in rows])
            )
        out, mass = impl.forward(q, cache, batch, layer, None)
        if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype:
            raise t.fail(f"forward returned {tuple(out.shape)} {out.dtype}, expected {tuple(q.shape)} {q.dtype}")
        exact = exact_attention(q, dense, batch, layer).float()
        rel = ((out.float() - exact).norm() / exact.norm()).item()
        if rules and not rel <= FORMAT_REL_TOL:
            raise t.fail(
                f"its attention over what write() stored is {rel:.3f} off exact attention over "
                f"the K/V it was given (relative error; at most {FORMAT_REL_TOL}) ({label}): "
                "write() loses or misplaces tokens, or forward() misreads the page"
            )
        if rules:
            observe = _observed(q.shape[0])
            _, mass = impl.forward(q, cache, batch, layer, observe)
            if mass is None or tuple(mass.shape) != tuple(batch.block_table.shape):
                raise t.fail(
                    f"forward(observe=...) returned mass {getattr(mass, 'shape', mass)}, expected "
                    f"{tuple(batch.block_table.shape)} (an eviction compressor that needs scores reads it)"
                )
            _, exact_mass = exact_attention_with_mass(q, dense, batch, layer, observe)
            mrel = ((mass.double() - exact_mass).norm() / exact_mass.norm()).item()
            if not mrel <= FORMAT_REL_TOL:
                raise t.fail(
                    f"forward(observe=...) returned attention mass {mrel:.3f} off the kit's exact mass "
                    f"over the K/V it was given (relative error; at most {FORMAT_REL_TOL}) ({label}): "
                    f"per sequence {[round(x, 3) for x in mass.double().sum(1).tolist()]}, expected "
                    f"{[round(x, 3) for x in exact_mass.sum(1).tolist()]}; mass[i, j] is the softmax "
                    "probability the observed queries put on block-table column j, summed over heads"
                )
        results.append((label, out))
        print(
            f"{t.spec} {label}: {width} bytes/token/head (dense fp16 {4 * d}), attention {rel:.3f} off exact (relative)"
        )
    if not results:
        raise Skipped(
            f"supports none of the kit's (head size, block size) shapes {[(s[2], s[3]) for s in ATTENTION_SHAPES]}"
        )
    return results
