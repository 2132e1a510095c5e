"""The checks of the conformance kit (see the package docstring), free of pytest.

Each check is a function of a :class:`Target` (a registered plugin and the parameters to
build it with) that returns a one-line summary of what it verified, raises
:class:`ConformanceError` naming the plugin, what broke and the fix, or raises
:class:`Skipped` saying why it does not apply. Inputs are generated from fixed seeds, so a
failure reproduces.

The shared pieces (:class:`Target`, :class:`ConformanceError`, :class:`Skipped`,
:func:`build`) are in :mod:`.base`; the per-kind exercises the ``contract`` and ``parity``
checks run (:data:`EXERCISES`) in :mod:`.exercises`, one module per kind. Their public names
are re-exported here.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from pydantic import BaseModel, ValidationError

from ...hooks import KERNEL_FIELD, Kind, Registry, get_registry
from ...hooks.contracts import SHAPE_CHECKS, shape_problems
from ...hooks.registry import Entry
from .base import (
    ConformanceError,
    Skipped,
    Target,
    build,
    example_params,
    exercise_dtypes,
    max_err,
    tolerance,
    torch_module,
)
from .device import check_device
from .exercises import EXERCISES
from .exercises.attention import (
    ATTENTION_SEQS,
    ATTENTION_SHAPES,
    exact_attention,
    exact_attention_with_mass,
    exercise_attention,
)
from .exercises.kvcompress import (
    FORMAT_REL_TOL,
    exercise_attend,
    exercise_kv_format,
    exercise_kvcompress,
)
from .exercises.moe import (
    MOE_EXPERTS,
    MOE_LAYERS,
    MOE_TOKENS,
    MOE_TOPK,
    exercise_moe,
    model_topk,
)
from .exercises.quant import QUANT_SHAPES, exercise_quant
from .exercises.speculative import (
    SPEC_REQUESTS,
    SPEC_STEPS,
    SPEC_VOCAB,
    check_state,
    exercise_speculative,
    request_id,
)

#: The distribution whose plugins ``"builtin"`` selects.
BUILTIN_PACKAGE = "vllm-graft"


@dataclass(frozen=True)
class Check:
    name: str
    doc: str
    func: Callable[[Target], str]
    #: Needs vLLM and the bundled models (skipped with ``--graft-no-engine``).
    engine: bool = False
    #: The kinds it applies to (None: every kind).
    kinds: tuple[Kind, ...] | None = None


# ------------------------------------------------------------------------ choosing plugins
def resolve_specs(specs: Sequence[str], registry: Registry | None = None) -> list[Entry]:
    """The registry entries named by ``specs``: ``"kind:name"``, ``"builtin"`` or ``"all"``."""
    registry = registry or get_registry()
    out: dict[tuple[Kind, str], Entry] = {}
    for spec in specs:
        if spec in ("all", "builtin"):
            for e in registry.entries():
                if spec == "all" or e.source.package == BUILTIN_PACKAGE:
                    out[(e.kind, e.name)] = e
            continue
        kind, sep, name = spec.partition(":")
        if not sep or kind not in {k.value for k in Kind}:
            raise ValueError(
                f"conformance target {spec!r}: write 'kind:name' (kind one of "
                f"{', '.join(k.value for k in Kind)}), 'builtin' or 'all'"
            )
        try:
            e = registry.get(kind, name)
        except KeyError as err:
            raise ValueError(
                f"conformance target {spec!r}: {err.args[0]}; is the plugin's "
                "package installed (pip install -e .) so its entry point is seen?"
            ) from None
        out[(e.kind, e.name)] = e
    return list(out.values())


# ----------------------------------------------------------------------- registration/params
def check_registration(t: Target) -> str:
    reg = t.entry.registration
    if not reg.summary.strip() or len(reg.summary.splitlines()) != 1:
        raise t.fail("summary must be one non-empty line")
    if not reg.paper.strip():
        raise t.fail("paper must name the paper it implements (title, venue/arXiv) or be '-'")
    caps = reg.capabilities
    if not caps.platforms:
        raise t.fail("capabilities.platforms is empty: declare 'cpu' and/or 'cuda'")
    if not caps.dtypes:
        raise t.fail("capabilities.dtypes is empty: declare the dtypes it runs with")
    if caps.head_sizes is not None and not caps.head_sizes:
        raise t.fail("capabilities.head_sizes is empty: use None for 'any' or list the sizes")
    impl = build(t)
    described = impl.describe()
    if not isinstance(described, dict):
        raise t.fail(f"describe() returned {type(described).__name__}, not a dict")
    try:
        json.dumps(described)
    except (TypeError, ValueError) as e:
        raise t.fail(f"describe() is not JSON-serialisable ({e}); return plain numbers/strings") from None
    return (
        f"impl {reg.impl} builds; lossless={caps.lossless}, platforms={list(caps.platforms)}, "
        f"dtypes={list(caps.dtypes)}"
    )


def check_shape(t: Target) -> str:
    """The class against its kind's shape rules (``hooks.contracts.SHAPE_CHECKS``), alone: the
    same check deployment validation runs, which also holds what it may be combined with."""
    cls = type(build(t))
    found = shape_problems(t.kind, cls)
    if found:
        raise t.fail("; ".join(p.message for p in found))
    flags = [f for f in ("needs_scores", "per_head", "per_layer", "merges") if getattr(cls, f, False)]
    return f"{cls.__name__}'s flags ({', '.join(flags) or 'none'}) and methods go together"


def check_params_roundtrip(t: Target) -> str:
    model = t.entry.registration.params
    p = model(**t.params)
    again = model.model_validate_json(p.model_dump_json())
    if again != p:
        raise t.fail(f"parameters {p!r} do not survive a JSON round trip (got {again!r})")
    if model(**p.model_dump()) != p:
        raise t.fail("model(**params.model_dump()) differs from params")
    return f"{len(model.model_fields)} field(s) round-trip through JSON"


def _wrong_value(annotation: Any) -> tuple[str, Any] | None:
    """A value of the wrong type for a field annotated ``annotation`` (None: no such value,
    e.g. ``Any`` or a union of unrelated types)."""
    import types
    import typing

    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, types.UnionType):
        return _wrong_value(args[0]) if len(args) == 1 else None
    if origin is typing.Literal:
        return ("a value not among its options", "graft-conformance-not-an-option")
    if origin is typing.Annotated:
        return _wrong_value(args[0])
    target = origin or annotation
    if target in (int, float, bool):
        return ("text where a number is expected", "not-a-number")
    if target in (list, tuple, set, frozenset, dict) or (isinstance(target, type) and issubclass(target, BaseModel)):
        return ("a number where a collection is expected", 12345)
    if target is str or (isinstance(target, type) and issubclass(target, os.PathLike)):
        return ("a mapping where text is expected", {"not": "valid"})
    return None


def _bad_values(info: Any) -> list[tuple[str, Any]]:
    """Values a field must refuse: a wrong type, and one step past each numeric bound."""
    out: list[tuple[str, Any]] = []
    wrong = _wrong_value(info.annotation)
    if wrong is not None:
        out.append(wrong)
    for meta in info.metadata:
        for attr in ("ge", "gt", "le", "lt"):
            bound = getattr(meta, attr, None)
            if not isinstance(bound, (int, float)) or isinstance(bound, bool):
                continue
            step = 1 if isinstance(bound, int) else max(abs(bound) * 1e-6, 1e-9)
            value = {"ge": bound - step, "le": bound + step}.get(attr, bound)  # gt/lt: the bound
            out.append((f"{attr}={bound} violated", value))
    return out


def check_params_reject(t: Target) -> str:
    model = t.entry.registration.params
    base = dict(t.params)
    tried = 0

    def must_fail(values: dict[str, Any], what: str) -> None:
        nonlocal tried
        tried += 1
        try:
            model(**values)
        except ValidationError:
            return
        raise t.fail(
            f"parameter model {model.__name__} accepted {what} ({values}); add a "
            "type/constraint so a deployment with it is refused before start-up"
        )

    must_fail(
        {**base, "graft_conformance_unknown_field": 1},
        "an unknown field (set model_config = ConfigDict(extra='forbid'))",
    )
    for name, info in model.model_fields.items():
        for what, value in _bad_values(info):
            must_fail({**base, name: value}, f"{name} = {value!r} ({what})")
    return f"refused {tried} bad parameter sets"


_dtypes = exercise_dtypes


def check_contract(t: Target) -> str:
    dtypes = _dtypes(t)
    labels = []
    for dtype in dtypes:
        impl = build(t)
        labels += [label for label, _ in EXERCISES[t.kind](t, impl, dtype, True)]
    return f"{len(labels)} generated case(s) keep the {t.kind.value} contract; " + "; ".join(labels[:4])


# ---------------------------------------------------------------------------------- parity
def compare(a: Any, b: Any, dtype: str, where: str = "") -> float:
    """Max abs difference between two results (tensors compared with tolerance, everything
    else exactly); raises ValueError on a structural or exact mismatch."""
    torch = torch_module()
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            raise ValueError(f"{where}: shapes differ ({getattr(a, 'shape', a)} vs {getattr(b, 'shape', b)})")
        if not a.is_floating_point():
            if not torch.equal(a, b):
                raise ValueError(f"{where}: integer tensors differ")
            return 0.0
        err = max_err(a, b)
        scale = max(b.float().abs().max().item(), 1.0) if b.numel() else 1.0
        if not math.isfinite(err) or err > tolerance(dtype) * 10 * scale:
            raise ValueError(f"{where}: max|diff| {err:.3g} (tolerance {tolerance(dtype) * 10 * scale:.3g})")
        return err
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            raise ValueError(f"{where}: keys differ ({sorted(a)} vs {sorted(b)})")
        return max([compare(a[k], b[k], dtype, f"{where}.{k}") for k in a] or [0.0])
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            raise ValueError(f"{where}: lengths differ ({len(a)} vs {len(b)})")
        return max([compare(x, y, dtype, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b))] or [0.0])
    if a != b:
        raise ValueError(f"{where}: {a!r} != {b!r}")
    return 0.0


def triton_runs_here() -> str | None:
    """Why Triton kernels cannot run in this process, or None if they can."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    torch = torch_module()
    if torch.cuda.is_available():
        return None
    return (
        "no GPU and TRITON_INTERPRET is not 1 (the pytest plugin sets it when a conformance "
        "test is collected; set it before triton is imported)"
    )


def check_parity(t: Target) -> str:
    params = t.entry.registration.params
    if KERNEL_FIELD not in params.model_fields:
        raise Skipped(
            f"no '{KERNEL_FIELD}' parameter, so the kit cannot switch the plugin to a "
            "Triton path (derive its parameters from vllm_graft.hooks.KernelParams when it "
            "has one)"
        )
    why = triton_runs_here()
    if why:
        raise Skipped(why)
    report: list[str] = []
    worst = (-1.0, "")
    for dtype in _dtypes(t):
        ref = EXERCISES[t.kind](t, build(t, **{KERNEL_FIELD: "reference"}), dtype, False)
        tri = EXERCISES[t.kind](t, build(t, **{KERNEL_FIELD: "triton"}), dtype, False)
        for (label, a), (_, b) in zip(ref, tri):
            try:
                err = compare(b, a, dtype, label)
            except ValueError as e:
                raise t.fail(f"kernel 'triton' differs from 'reference': {e}") from None
            report.append(f"{label}: max|diff| {err:.2e}")
            worst = max(worst, (err, label))
    print("\n".join(report))
    return f"{len(report)} case(s): triton matches reference; largest difference {worst[0]:.2e} ({worst[1]})"


def check_engine(t: Target) -> str:
    from .engine import run_engine_check

    return run_engine_check(t)


CHECKS: list[Check] = [
    Check("registration", "registration fields; impl imports, builds and describes itself", check_registration),
    Check(
        "shape",
        "the class's flags and methods go together (its kind's shape rules)",
        check_shape,
        kinds=tuple(SHAPE_CHECKS),
    ),
    Check("params-roundtrip", "the parameter model survives JSON", check_params_roundtrip),
    Check("params-reject", "unknown fields, wrong types and out-of-bound values are refused", check_params_reject),
    Check("contract", "the reference path keeps the kind's rules on generated inputs", check_contract),
    Check("parity", "Triton kernels match the reference (TRITON_INTERPRET=1)", check_parity),
    Check("device", "on a fake CUDA device: no host tensor mixed in; host syncs per call reported", check_device),
    Check(
        "state", "nothing of a request is held after finish()", check_state, kinds=(Kind.SPECULATIVE,)
    ),  # the one kind told when a request ends
    Check("engine", "in vLLM's CPU engine; lossless = plain vLLM's greedy tokens", check_engine, engine=True),
]

__all__ = [
    "ATTENTION_SEQS",
    "ATTENTION_SHAPES",
    "BUILTIN_PACKAGE",
    "CHECKS",
    "Check",
    "ConformanceError",
    "EXERCISES",
    "FORMAT_REL_TOL",
    "MOE_EXPERTS",
    "MOE_LAYERS",
    "MOE_TOKENS",
    "MOE_TOPK",
    "QUANT_SHAPES",
    "SPEC_REQUESTS",
    "SPEC_STEPS",
    "SPEC_VOCAB",
    "Skipped",
    "Target",
    "build",
    "check_contract",
    "check_device",
    "check_engine",
    "check_params_reject",
    "check_params_roundtrip",
    "check_parity",
    "check_registration",
    "check_shape",
    "check_state",
    "compare",
    "example_params",
    "exact_attention",
    "exact_attention_with_mass",
    "exercise_attend",
    "exercise_attention",
    "exercise_kv_format",
    "exercise_kvcompress",
    "exercise_moe",
    "exercise_quant",
    "exercise_speculative",
    "model_topk",
    "request_id",
    "resolve_specs",
    "triton_runs_here",
]
