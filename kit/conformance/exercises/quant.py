"""The kit's quant exercise: ``quantize`` / ``load`` / ``apply`` on generated weights, checked
against ``x @ W.T + b`` and against the tensors ``stored_tensors`` declares; ``dense_weight``
against what ``apply`` computes; for a method with pre-quantised checkpoints (``stored_tensors``)
the checkpoint path (``checkpoint_params``, ``verify`` and ``load`` of a layer fused from shards
quantised one by one, as q/k/v are); ``embed`` (``covers_embeddings``) against the table's rows.
"""

from __future__ import annotations

from typing import Any

from vllm_graft.kit.conformance.base import Target, tolerance, torch_dtype, torch_module

QUANT_SHAPES = [(64, 128, 1), (96, 256, 5), (128, 128, 3)]  # (out, in, tokens)


def exercise_quant(t: Target, impl: Any, dtype: str, rules: bool) -> list[tuple[str, Any]]:
    torch = torch_module()
    dt = torch_dtype(dtype)
    lossless = t.entry.registration.capabilities.lossless
    results = []
    for j, (n_out, n_in, n_tok) in enumerate(QUANT_SHAPES):
        g = torch.Generator().manual_seed(300 + j)
        w = (torch.randn(n_out, n_in, generator=g) * 0.05).to(dt)
        x = torch.randn(n_tok, n_in, generator=g).to(dt)
        bias = (torch.randn(n_out, generator=g) * 0.1).to(dt) if j % 2 == 0 else None
        w_before = w.clone()
        stored = impl.quantize(w)
        label = f"[{n_out}, {n_in}] x {n_tok} tokens {dtype} bias={bias is not None}"
        if rules:
            if not isinstance(stored, dict) or not all(isinstance(v, torch.Tensor) for v in stored.values()):
                raise t.fail(f"quantize() must return a dict of tensors, got {type(stored).__name__}")
            if not torch.equal(w, w_before):
                raise t.fail("quantize() modified the weight in place")
            declared = impl.stored_tensors(n_out, n_in)
            if declared is not None:
                _check_stored(t, declared, stored, label)
        # as the quant adapter computes online: apply() gets load() of quantize()
        tensors = impl.load({k: [v] for k, v in stored.items()}, [n_out])
        out = impl.apply(tensors, x, bias)
        if rules:
            if out.shape != (n_tok, n_out) or out.dtype != x.dtype:
                raise t.fail(
                    f"apply() returned {tuple(out.shape)} {out.dtype} for x {tuple(x.shape)} "
                    f"{x.dtype} and weight [{n_out}, {n_in}]: it must be [T, out] in x's dtype"
                )
            if not torch.isfinite(out).all():
                raise t.fail(f"apply() returned non-finite values ({label})")
            ref = (x.double() @ w.double().T) + (bias.double() if bias is not None else 0)
            rel = ((out.double() - ref).norm() / ref.norm()).item()
            if lossless and rel > tolerance(dtype):
                raise t.fail(f"declared lossless but apply() is off x @ W.T + b by {rel:.3g} (relative, {label})")
            if rel >= 1.0:
                raise t.fail(f"apply() is off x @ W.T + b by {rel:.3g} (relative, {label}): worse than returning zeros")
            _check_dense_weight(t, impl, tensors, w, x, bias, out, label)
            if declared is not None:
                _check_checkpoint(t, impl, w, x, bias, dt, lossless, label)
            label += f" rel.err {rel:.2e}"
        results.append((label, out))
    if getattr(impl, "covers_embeddings", False):
        results += _exercise_embed(t, impl, dt, dtype, lossless, rules)
    return results


def _rel(out: Any, ref: Any) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def _check_dense_weight(t: Target, impl: Any, tensors: dict, w: Any, x: Any, bias: Any, out: Any, label: str) -> None:
    """``dense_weight()``: None, or ``[out, in]`` in the layer's dtype with ``apply`` exactly
    ``F.linear(x, W, bias)`` (the host then computes with it instead of calling ``apply``)."""
    torch = torch_module()
    dense = impl.dense_weight(tensors)
    if dense is None:
        return
    if not isinstance(dense, torch.Tensor) or tuple(dense.shape) != tuple(w.shape) or dense.dtype != w.dtype:
        raise t.fail(
            f"dense_weight() returned {getattr(dense, 'shape', type(dense).__name__)} "
            f"{getattr(dense, 'dtype', '')} ({label}); it must be None or the weight [out, in] = "
            f"{list(w.shape)} in the layer's dtype {w.dtype}"
        )
    host = torch.nn.functional.linear(x.double(), dense.double(), None if bias is None else bias.double())
    rel = _rel(out, host) if host.norm() > 0 else float(out.double().norm())
    if rel > tolerance(str(x.dtype).removeprefix("torch.")):
        raise t.fail(
            f"dense_weight() is not the weight apply() computes with: F.linear(x, dense_weight(), "
            f"bias) is {rel:.3g} off apply() (relative, {label}); the host computes the layer with "
            "dense_weight() and never calls apply(), so the two must agree (or return None)"
        )


def _check_checkpoint(t: Target, impl: Any, w: Any, x: Any, bias: Any, dt: Any, lossless: bool, label: str) -> None:
    """The pre-quantised path: ``checkpoint_params()`` builds the plugin again; a layer fused from
    two shards quantised one by one (as ``vllm-graft quantize`` writes q/k/v) passes ``verify`` per
    shard, and ``load`` of the per-shard tensors computes ``x @ W.T + b`` through ``apply``."""
    import json

    from pydantic import ValidationError

    torch = torch_module()
    cp = impl.checkpoint_params()
    try:
        json.dumps(cp)
        t.entry.registration.params(**cp)
    except (TypeError, ValueError, ValidationError) as e:
        raise t.fail(
            f"checkpoint_params() returned {cp!r:.200}, which a checkpoint cannot rebuild the plugin "
            f"from ({type(e).__name__}: {' '.join(str(e).split())[:200]}); return JSON-serialisable parameters the "
            "parameter model accepts"
        ) from None
    rows = [w.shape[0] // 2, w.shape[0] - w.shape[0] // 2]
    shards = [impl.quantize(part) for part in torch.split(w, rows, 0)]
    for i, shard in enumerate(shards):
        try:
            impl.verify(dict(shard))
        except ValueError as e:
            raise t.fail(
                f"verify() refused shard {i} as quantize() made it: {e} ({label}); it must accept "
                "what quantize() writes"
            ) from None
    stored = {k: [s[k] for s in shards] for k in shards[0]}
    try:
        tensors = impl.load(stored, rows)
    except ValueError as e:
        raise t.fail(
            f"load() refused a layer of {len(rows)} shards (rows {rows}) as quantize() made them: {e} ({label})"
        ) from None
    out = impl.apply(tensors, x, bias)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (x.shape[0], w.shape[0]) or out.dtype != x.dtype:
        raise t.fail(
            f"apply() after load() of {len(rows)} shards returned {getattr(out, 'shape', out)} "
            f"{getattr(out, 'dtype', '')} ({label}); expected [T, out] = {[x.shape[0], w.shape[0]]} in {x.dtype}"
        )
    ref = (x.double() @ w.double().T) + (bias.double() if bias is not None else 0)
    rel = _rel(out, ref)
    limit = tolerance(str(dt).removeprefix("torch.")) if lossless else 1.0
    if not rel < limit:
        raise t.fail(
            f"load() of a layer fused from {len(rows)} shards (rows {rows}, each quantised on its "
            f"own, as a pre-quantised checkpoint holds q/k/v) then apply() is {rel:.3g} off "
            f"x @ W.T + b (relative, {label}; at most {limit:g}): load() must put each shard's rows "
            "in order"
        )


#: (vocabulary, hidden, ids) of the embedding table the kit quantises (``covers_embeddings``)
EMBED_SHAPE = (96, 64, 11)


def _exercise_embed(t: Target, impl: Any, dt: Any, dtype: str, lossless: bool, rules: bool) -> list[tuple[str, Any]]:
    """``embed()`` (``covers_embeddings``): rows ``ids`` of a quantised embedding table."""
    torch = torch_module()
    vocab, hidden, n = EMBED_SHAPE
    g = torch.Generator().manual_seed(350)
    table = torch.randn(vocab, hidden, generator=g).to(dt)
    ids = torch.randint(0, vocab, (n,), generator=g)
    ids[0], ids[1] = 0, vocab - 1
    tensors = impl.load({k: [v] for k, v in impl.quantize(table).items()}, [vocab])
    got = impl.embed(tensors, ids)
    label = f"embed [{vocab}, {hidden}] x {n} ids {dtype}"
    if rules:
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != (n, hidden):
            raise t.fail(
                f"embed() returned {getattr(got, 'shape', type(got).__name__)} for {n} ids of a "
                f"[{vocab}, {hidden}] table; it must be [*ids.shape, hidden] = [{n}, {hidden}]"
            )
        rel = _rel(got, table[ids].double())
        limit = tolerance(dtype) if lossless else 1.0
        if not rel < limit:
            raise t.fail(
                f"embed() is {rel:.3g} off the table's rows table[ids] (relative, {label}; at most "
                f"{limit:g}): it must return the rows of the ids asked, in order"
            )
        label += f" rel.err {rel:.2e}"
    return [(label, got)]


def _check_stored(t: Target, declared: dict[str, Any], stored: dict[str, Any], label: str) -> None:
    """``quantize`` returns what ``stored_tensors`` declares (a pre-quantised checkpoint is
    loaded by those declarations)."""
    if set(declared) != set(stored):
        raise t.fail(
            f"quantize() returned tensors {sorted(stored)} but stored_tensors() declares {sorted(declared)} ({label})"
        )
    for name, spec in declared.items():
        got = stored[name]
        if str(got.dtype).removeprefix("torch.") != spec.dtype:
            raise t.fail(f"quantize()[{name!r}] is {got.dtype}, stored_tensors() says {spec.dtype} ({label})")
        if spec.ragged:
            if got.dim() != 1:
                raise t.fail(
                    f"quantize()[{name!r}] is declared ragged (1-D) but has shape {tuple(got.shape)} ({label})"
                )
        elif tuple(got.shape) != tuple(spec.shape):
            raise t.fail(
                f"quantize()[{name!r}] has shape {tuple(got.shape)}, stored_tensors() "
                f"says {tuple(spec.shape)} ({label})"
            )
