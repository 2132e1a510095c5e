"""The kit's quant exercise: ``quantize`` / ``load`` / ``apply`` on generated weights, checked
against ``x @ W.T + b`` and against the tensors ``stored_tensors`` declares.
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
                raise t.fail(f"apply() returned {tuple(out.shape)} {out.dtype} for x {tuple(x.shape)} "
                             f"{x.dtype} and weight [{n_out}, {n_in}]: it must be [T, out] in x's dtype")
            if not torch.isfinite(out).all():
                raise t.fail(f"apply() returned non-finite values ({label})")
            ref = (x.double() @ w.double().T) + (bias.double() if bias is not None else 0)
            rel = ((out.double() - ref).norm() / ref.norm()).item()
            if lossless and rel > tolerance(dtype):
                raise t.fail(f"declared lossless but apply() is off x @ W.T + b by {rel:.3g} "
                             f"(relative, {label})")
            if rel >= 1.0:
                raise t.fail(f"apply() is off x @ W.T + b by {rel:.3g} (relative, {label}): worse "
                             "than returning zeros")
            label += f" rel.err {rel:.2e}"
        results.append((label, out))
    return results


def _check_stored(t: Target, declared: dict[str, Any], stored: dict[str, Any], label: str) -> None:
    """``quantize`` returns what ``stored_tensors`` declares (a pre-quantised checkpoint is
    loaded by those declarations)."""
    if set(declared) != set(stored):
        raise t.fail(f"quantize() returned tensors {sorted(stored)} but stored_tensors() declares "
                     f"{sorted(declared)} ({label})")
    for name, spec in declared.items():
        got = stored[name]
        if str(got.dtype).removeprefix("torch.") != spec.dtype:
            raise t.fail(f"quantize()[{name!r}] is {got.dtype}, stored_tensors() says {spec.dtype} ({label})")
        if spec.ragged:
            if got.dim() != 1:
                raise t.fail(f"quantize()[{name!r}] is declared ragged (1-D) but has shape "
                             f"{tuple(got.shape)} ({label})")
        elif tuple(got.shape) != tuple(spec.shape):
            raise t.fail(f"quantize()[{name!r}] has shape {tuple(got.shape)}, stored_tensors() "
                         f"says {tuple(spec.shape)} ({label})")
