"""The kit's quant exercise: ``quantize`` / ``load`` / ``apply`` on generated weights, checked
against ``x @ W.T + b`` and against the tensors ``stored_tensors`` declares; ``dense_weight``
against what ``apply`` computes; for a method with pre-quantised checkpoints (``stored_tensors``)
the checkpoint path (``checkpoint_params``, ``verify`` and ``load`` of a layer fused from shards
quantised one by one, as q/k/v are); ``embed`` (``covers_embeddings``) against the table's rows.
"""

from __future__ import annotations

from typing import Any

from ..base import Target, tolerance, torch_dtype, torch_module

QUANT_SHAPES = [(64, 128, 1), (96, 256, 5), (128, 128, 3)]  # (out, in, tokens): random layers
#: (out, in, tokens) of the structured layer (:func:`structured_layer`)
STRUCTURED_SHAPE = (128, 256, 16)


def structured_layer(n_out: int, n_in: int, n_tok: int, seed: int = 399) -> tuple[Any, Any]:
    """A float32 weight ``[out, in]`` and activations ``[tokens, in]`` shaped as a trained
    model's are, where random ones are not: the weight's singular values fall as ``1 / (1 + i)``
    (a trained layer's spectrum decays; ``randn``'s is flat, so a low-rank part of it holds
    little and a broken low-rank path errs no more than a correct one), and 1 input channel in
    32 is an outlier: its weight column x3 and its activations x8 (LLM.int8()'s outlier
    features), what outlier-aware methods keep exact. Scaled to the random layers' weight
    scale (std 0.05)."""
    torch = torch_module()
    g = torch.Generator().manual_seed(seed)
    k = min(n_out, n_in)
    u, _ = torch.linalg.qr(torch.randn(n_out, k, generator=g))
    v, _ = torch.linalg.qr(torch.randn(n_in, k, generator=g))
    w = (u / (1.0 + torch.arange(k, dtype=torch.float32))) @ v.T
    outliers = torch.randperm(n_in, generator=g)[: max(1, n_in // 32)]
    w[:, outliers] *= 3.0
    w = w * (0.05 / w.std())
    x = torch.randn(n_tok, n_in, generator=g)
    x[:, outliers] *= 8.0
    return w, x


#: the kinds of layer the exercise quantises, as :meth:`QuantMethod.error_bound` is asked them
LAYER_KINDS = ("random", "structured")


def _layers(dt: Any) -> list[tuple[str, str, Any, Any, Any]]:
    """(kind, label, weight, x, bias) of every layer the exercise quantises, the structured one
    first (so the contract check's summary, its first labels, gives its error)."""
    torch = torch_module()
    w, x = structured_layer(*STRUCTURED_SHAPE)
    n_out, n_in, n_tok = STRUCTURED_SHAPE
    out = [
        (
            "structured",
            f"structured [{n_out}, {n_in}] x {n_tok} tokens (decaying spectrum, outlier channels)",
            w.to(dt),
            x.to(dt),
            None,
        )
    ]
    for j, (n_out, n_in, n_tok) in enumerate(QUANT_SHAPES):
        g = torch.Generator().manual_seed(300 + j)
        w = (torch.randn(n_out, n_in, generator=g) * 0.05).to(dt)
        x = torch.randn(n_tok, n_in, generator=g).to(dt)
        bias = (torch.randn(n_out, generator=g) * 0.1).to(dt) if j % 2 == 0 else None
        out.append(("random", f"[{n_out}, {n_in}] x {n_tok} tokens", w, x, bias))
    return out


def exercise_quant(t: Target, impl: Any, dtype: str, rules: bool) -> list[tuple[str, Any]]:
    torch = torch_module()
    dt = torch_dtype(dtype)
    lossless = t.entry.registration.capabilities.lossless
    results = []
    bounds = {kind: None if lossless else _declared_bound(t, impl, kind) for kind in LAYER_KINDS}
    for kind, name, w, x, bias in _layers(dt):
        bound = bounds[kind]
        n_out, n_in = w.shape
        n_tok = x.shape[0]
        w_before = w.clone()
        stored = impl.quantize(w)
        label = f"{name} {dtype} bias={bias is not None}"
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
            if bound is not None and rel > bound:
                raise t.fail(
                    f"apply() is off x @ W.T + b by {rel:.3g} (relative, {label}), beyond the "
                    f"{bound:.3g} its error_bound({kind!r}) declares: a path of the method is broken, or the "
                    "bound is wrong for these parameters"
                )
            _check_dense_weight(t, impl, tensors, w, x, bias, out, label)
            if declared is not None:
                _check_checkpoint(t, impl, w, x, bias, dt, lossless, label, bound)
            label += f" rel.err {rel:.2e}" + (
                "" if lossless else f" (bound {bound:.3g})" if bound else " (no error_bound)"
            )
        results.append((label, out))
    if getattr(impl, "covers_embeddings", False):
        results += _exercise_embed(t, impl, dt, dtype, lossless, rules)
    return results


def _declared_bound(t: Target, impl: Any, kind: str) -> float | None:
    bound = impl.error_bound(kind)
    if bound is not None and not (isinstance(bound, (int, float)) and 0.0 < bound < 1.0):
        raise t.fail(
            f"error_bound({kind!r}) returned {bound!r}: it must be None or the largest relative error, a "
            "number in (0, 1)"
        )
    return None if bound is None else float(bound)


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


def _check_checkpoint(
    t: Target, impl: Any, w: Any, x: Any, bias: Any, dt: Any, lossless: bool, label: str, bound: float | None = None
) -> None:
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
    limit = tolerance(str(dt).removeprefix("torch.")) if lossless else (bound or 1.0)
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
