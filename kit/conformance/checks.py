"""The checks of the conformance kit (see the package docstring), free of pytest.

Each check is a function of a :class:`Target` (a registered plugin and the parameters to
build it with) that returns a one-line summary of what it verified, raises
:class:`ConformanceError` naming the plugin, what broke and the fix, or raises
:class:`Skipped` saying why it does not apply. Inputs are generated from fixed seeds, so a
failure reproduces.
"""
from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from pydantic import BaseModel, ValidationError

from vllm_graft.hooks import (
    contract_for,
    KERNEL_FIELD,
    AttentionLayer,
    BlockView,
    KVCacheFormat,
    Kind,
    MoEModel,
    PagedBatch,
    Registry,
    get_registry,
)
from vllm_graft.hooks.contracts import split_kv_cache
from vllm_graft.integration.adapters.kvcompress.keep import KeepError, check_keep, dropped_blocks
from vllm_graft.hooks.registry import Entry

#: The distribution whose plugins ``"builtin"`` selects.
BUILTIN_PACKAGE = "vllm-graft"


class ConformanceError(AssertionError):
    """A plugin breaks its kind's contract; the message names the plugin and the fix."""


class Skipped(Exception):
    """The check does not apply to this plugin (the message says why)."""


@dataclass(frozen=True)
class Target:
    """One plugin under test, with the parameters (a dict, as in a deployment) to use."""

    entry: Entry
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> Kind:
        return self.entry.kind

    @property
    def spec(self) -> str:
        return f"{self.entry.kind.value}:{self.entry.name}"

    def fail(self, what: str) -> ConformanceError:
        src = self.entry.source
        return ConformanceError(f"{self.spec} (from {src.package} {src.version}): {what}")


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
            raise ValueError(f"conformance target {spec!r}: write 'kind:name' (kind one of "
                             f"{', '.join(k.value for k in Kind)}), 'builtin' or 'all'")
        try:
            e = registry.get(kind, name)
        except KeyError as err:
            raise ValueError(f"conformance target {spec!r}: {err.args[0]}; is the plugin's "
                             "package installed (pip install -e .) so its entry point is seen?") from None
        out[(e.kind, e.name)] = e
    return list(out.values())


def example_params(entry: Entry, override: dict[str, Any] | None = None) -> dict[str, Any]:
    """Parameters to build the plugin with: ``override``, else the model's defaults, else the
    first of its ``json_schema_extra["examples"]``."""
    model = entry.registration.params
    if override is not None:
        return dict(override)
    try:
        model()
        return {}
    except ValidationError:
        pass
    extra = model.model_config.get("json_schema_extra") or {}
    examples = extra.get("examples") if isinstance(extra, dict) else None
    if examples:
        return dict(examples[0])
    raise ConformanceError(
        f"{entry.kind.value}:{entry.name}: parameter model {model.__name__} has required fields "
        "and no example; add model_config = ConfigDict(extra='forbid', json_schema_extra="
        "{'examples': [{...}]}) or pass params= to the graft_conformance marker")


def build(target: Target, **changes: Any) -> Any:
    """The plugin's implementation, built as the vLLM adapters build it."""
    reg = target.entry.registration
    values = {**target.params, **changes}
    try:
        params = reg.params(**values)
    except ValidationError as e:
        raise target.fail(f"its parameters {values} do not validate: {e}") from None
    cls = reg.load()
    contract = contract_for(target.kind, reg.capabilities.role)
    if not (isinstance(cls, type) and issubclass(cls, contract)):
        raise target.fail(f"impl {reg.impl!r} is {cls!r}, not a subclass of "
                          f"vllm_graft.hooks.{contract.__name__}")
    return cls(params)


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
    return (f"impl {reg.impl} builds; lossless={caps.lossless}, platforms={list(caps.platforms)}, "
            f"dtypes={list(caps.dtypes)}")


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
        raise t.fail(f"parameter model {model.__name__} accepted {what} ({values}); add a "
                     "type/constraint so a deployment with it is refused before start-up")

    must_fail({**base, "graft_conformance_unknown_field": 1},
              "an unknown field (set model_config = ConfigDict(extra='forbid'))")
    for name, info in model.model_fields.items():
        for what, value in _bad_values(info):
            must_fail({**base, name: value}, f"{name} = {value!r} ({what})")
    return f"refused {tried} bad parameter sets"


# ------------------------------------------------------------------------- per-kind inputs
def _torch():
    import torch

    return torch


def _dtype(name: str):
    return getattr(_torch(), name)


def _tol(dtype: str) -> float:
    return {"float32": 2e-4, "float16": 2e-2, "bfloat16": 1e-1}[dtype]


def _max_err(a: Any, b: Any) -> float:
    torch = _torch()
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


# attention -----------------------------------------------------------------------------
ATTENTION_SHAPES = [  # (heads, kv heads, head size, block size)
    (4, 2, 64, 16),
    (4, 4, 128, 32),
    (8, 2, 64, 32),
]
#: Per sequence (tokens in the cache including the new ones, new tokens): one prefill,
#: decodes of ragged lengths, a chunked-prefill continuation.
ATTENTION_SEQS = [(7, 7), (40, 1), (19, 3), (33, 1)]


def _attention_case(shape: tuple[int, int, int, int], dtype: str, seed: int):
    torch = _torch()
    h, hkv, d, bs = shape
    g = torch.Generator().manual_seed(seed)
    needed = [-(-n // bs) for n, _ in ATTENTION_SEQS]
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(needed) + 1
    table = torch.zeros(len(ATTENTION_SEQS), width, dtype=torch.int32)
    at = 0
    for i, k in enumerate(needed):
        table[i, :k] = torch.tensor(perm[at:at + k], dtype=torch.int32)
        # the unused tail points at real (other sequences') blocks: a method that reads
        # past seq_len gets wrong numbers, not zeros
        table[i, k:] = torch.tensor(perm[:width - k], dtype=torch.int32)
        at += k
    qsl = [0]
    for _, q in ATTENTION_SEQS:
        qsl.append(qsl[-1] + q)
    batch = PagedBatch(query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                       seq_lens=torch.tensor([n for n, _ in ATTENTION_SEQS], dtype=torch.int32),
                       block_table=table)
    dt = _dtype(dtype)
    kv = torch.randn(num_blocks, hkv, bs, 2 * d, generator=g).to(dt)
    q = torch.randn(qsl[-1], h, d, generator=g).to(dt)
    layer = AttentionLayer(num_heads=h, num_kv_heads=hkv, head_size=d, scale=d ** -0.5, block_size=bs)
    return q, kv, batch, layer


def exact_attention(q, kv, batch: PagedBatch, layer: AttentionLayer):
    """The kit's own oracle: token-by-token gather of the paged cache (per block and head,
    ``block_size`` keys then ``block_size`` values), causal softmax in float64."""
    torch = _torch()
    bs, d = layer.block_size, layer.head_size
    flat = kv.reshape(kv.shape[0], kv.shape[1], 2 * bs * d)  # per block and KV head

    def token(i: int, p: int, which: int):  # which 0: key, 1: value
        start = (which * bs + p % bs) * d
        return flat[int(batch.block_table[i, p // bs]), :, start:start + d]

    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(batch.seq_lens.numel()):
        n = int(batch.seq_lens[i])
        q0, q1 = int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1])
        keys = torch.stack([token(i, p, 0) for p in range(n)])
        vals = torch.stack([token(i, p, 1) for p in range(n)])
        keys, vals = keys.double(), vals.double()  # [n, Hkv, D]
        for r in range(q1 - q0):
            pos = n - (q1 - q0) + r  # the query's own position: it sees keys 0..pos
            for hh in range(layer.num_heads):
                kvh = hh // (layer.num_heads // layer.num_kv_heads)
                s = keys[: pos + 1, kvh] @ q[q0 + r, hh].double() * layer.scale
                out[q0 + r, hh] = torch.softmax(s, 0) @ vals[: pos + 1, kvh]
    return out


def exercise_attention(t: Target, impl: Any, dtype: str, rules: bool) -> list[tuple[str, Any]]:
    torch = _torch()
    results = []
    lossless = t.entry.registration.capabilities.lossless
    sizes = t.entry.registration.capabilities.head_sizes
    for j, shape in enumerate(ATTENTION_SHAPES):
        if sizes is not None and shape[2] not in sizes:
            continue
        q, kv, batch, layer = _attention_case(shape, dtype, seed=100 + j)
        kv_before, q_before = kv.clone(), q.clone()
        plan = impl.plan(batch)
        out = impl.forward(q, kv, batch, layer, plan)
        label = f"H={shape[0]} Hkv={shape[1]} D={shape[2]} block={shape[3]} {dtype}"
        if rules:
            if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype:
                raise t.fail(f"forward returned {getattr(out, 'shape', out)} "
                             f"{getattr(out, 'dtype', '')} for query {tuple(q.shape)} {q.dtype} "
                             f"({label}); it must return [T, H, D] in the query's dtype")
            if not torch.isfinite(out).all():
                raise t.fail(f"forward returned non-finite values ({label})")
            if not (torch.equal(kv, kv_before) and torch.equal(q, q_before)):
                raise t.fail(f"forward modified its query or KV cache in place ({label})")
            if lossless:
                err = _max_err(out, exact_attention(q, kv, batch, layer))
                if err > _tol(dtype) * 10:
                    raise t.fail(f"declared lossless, but its output differs from exact causal "
                                 f"attention by {err:.3g} ({label})")
                label += f" max|err| vs exact {err:.2e}"
        results.append((label, out))
    if not results:
        raise Skipped(f"declares head sizes {sizes}; the kit generates {sorted({s[2] for s in ATTENTION_SHAPES})}")
    return results


# kvcompress ----------------------------------------------------------------------------
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
    torch = _torch()
    results = []
    for shape in ATTENTION_SHAPES:
        h, hkv, d, bs = shape
        if impl.unsupported(d, bs):
            continue
        label = f"format heads={h}/{hkv} head={d} block={bs} {dtype}"
        width = impl.bytes_per_token(d, bs)
        if not isinstance(width, int) or width <= 0:
            raise t.fail(f"bytes_per_token({d}, {bs}) returned {width!r}, not a positive int")
        q, dense, batch, layer = _attention_case(shape, dtype, seed=11)
        dense.zero_()
        cache = torch.zeros(dense.shape[0], hkv, bs, width, dtype=torch.uint8)
        g = torch.Generator().manual_seed(12)
        k_dense, v_dense = split_kv_cache(dense)
        kv = []
        for i, (n, _) in enumerate(ATTENTION_SEQS):
            k = torch.randn(n, hkv, d, generator=g).to(_dtype(dtype))
            v = torch.randn(n, hkv, d, generator=g).to(_dtype(dtype))
            slots = batch.block_table[i, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
            k_dense[slots // bs, :, slots % bs] = k
            v_dense[slots // bs, :, slots % bs] = v
            kv.append((k, v, slots))
        # step 0: every sequence's cached tokens, with padding slots between them
        parts = [(k[:n - qn], v[:n - qn], s[:n - qn]) for (k, v, s), (n, qn) in zip(kv, ATTENTION_SEQS)]
        pad = (torch.zeros(2, hkv, d, dtype=_dtype(dtype)), torch.zeros(2, hkv, d, dtype=_dtype(dtype)),
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


# speculative ---------------------------------------------------------------------------
SPEC_REQUESTS = 6
SPEC_STEPS = 25
SPEC_VOCAB = 64


def _truth(r: int, length: int) -> list[int]:
    """Request r's 'target model' continuation: a repetitive sequence (drafts can hit)."""
    rnd = random.Random(r)
    motif = [rnd.randrange(SPEC_VOCAB) for _ in range(3 + r % 4)]
    return [motif[i % len(motif)] if rnd.random() > 0.15 else rnd.randrange(SPEC_VOCAB)
            for i in range(length)]


def request_id(r: int) -> str:
    return f"graft-conformance-req-{r}"


def exercise_speculative(t: Target, impl: Any, dtype: str, rules: bool) -> list[tuple[str, Any]]:
    import numpy as np

    results = []
    topk = int(getattr(impl, "topk", 0) or 0)
    for r in range(SPEC_REQUESTS):
        rid = request_id(r)
        truth = _truth(r, 40 + SPEC_STEPS * 6)
        tokens = truth[:40]
        drafts_seen = []
        rnd = random.Random(1000 + r)
        for _ in range(SPEC_STEPS):
            max_tokens = 4
            impl.begin_step(1, 1 + (len(drafts_seen[-1]) if drafts_seen else 0))
            drafts = impl.propose(rid, list(tokens), max_tokens)
            try:
                drafts = [int(x) for x in drafts]
            except (TypeError, ValueError):
                raise t.fail(f"propose() returned {drafts!r}; it must return a list of token ids") from None
            if rules and (len(drafts) > max_tokens or any(x < 0 for x in drafts)):
                raise t.fail(f"propose() returned {drafts} for max_tokens={max_tokens}: at most "
                             "max_tokens non-negative token ids")
            drafts = drafts[:max_tokens]
            nxt = truth[len(tokens):len(tokens) + len(drafts) + 1]
            acc = 0
            while acc < len(drafts) and drafts[acc] == nxt[acc]:
                acc += 1
            if topk > 0:  # what the target predicted at each computed position (row 0: the true next)
                positions = [tokens[-1], *drafts]
                rows = [[truth[len(tokens) + j] if len(tokens) + j < len(truth) else 0,
                         *(rnd.randrange(SPEC_VOCAB) for _ in range(topk - 1))]
                        for j in range(len(positions))]
                impl.observe_topk(rid, positions, np.array(rows, dtype=np.int64))
            if drafts:
                impl.accepted(rid, acc, len(drafts))
            tokens += nxt[: acc + 1]
            drafts_seen.append(drafts)
        results.append((rid, drafts_seen))
    for r in range(SPEC_REQUESTS):
        impl.finish(request_id(r))
    return results


def _holders(obj: Any, needles: set[str], path: str, depth: int, seen: set[int]) -> list[str]:
    if id(obj) in seen or depth > 5:
        return []
    seen.add(id(obj))
    found: list[str] = []
    if isinstance(obj, str):
        return [path] if obj in needles else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(k, str) and k in needles:
                found.append(f"{path}[{k!r}]")
            found += _holders(v, needles, f"{path}[{k!r}]", depth + 1, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            found += _holders(v, needles, f"{path}[{i}]", depth + 1, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        if type(obj).__module__.split(".")[0] in ("torch", "numpy"):
            return found
        for k, v in vars(obj).items():
            found += _holders(v, needles, f"{path}.{k}", depth + 1, seen)
    return found


def check_state(t: Target) -> str:
    impl = build(t)
    exercise_speculative(t, impl, "float32", rules=False)  # ends with finish() for every request
    held = _holders(impl, {request_id(r) for r in range(SPEC_REQUESTS)}, "self", 0, set())
    if held:
        raise t.fail(f"after finish() it still holds finished requests in {held[:5]}; "
                     "release per-request state in finish()")
    return f"{SPEC_REQUESTS} requests x {SPEC_STEPS} steps, nothing held after finish()"


# quant ---------------------------------------------------------------------------------
QUANT_SHAPES = [(64, 128, 1), (96, 256, 5), (128, 128, 3)]  # (out, in, tokens)


def exercise_quant(t: Target, impl: Any, dtype: str, rules: bool) -> list[tuple[str, Any]]:
    torch = _torch()
    dt = _dtype(dtype)
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
            if lossless and rel > _tol(dtype):
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


# moe -----------------------------------------------------------------------------------
MOE_EXPERTS, MOE_TOPK, MOE_TOKENS, MOE_LAYERS = 8, 2, 9, 4


def model_topk(logits, top_k: int, renormalize: bool):
    """The plain top-k routing a lossless scheduler must reproduce."""
    torch = _torch()
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w, ids


def exercise_moe(t: Target, impl: Any, dtype: str, rules: bool) -> list[tuple[str, Any]]:
    torch = _torch()
    cls = type(impl)
    lossless = t.entry.registration.capabilities.lossless
    try:  # as the MoE adapter does at activation
        impl.bind(MoEModel(num_layers=MOE_LAYERS, num_experts=MOE_EXPERTS, top_k=MOE_TOPK,
                           model="graft-conformance"))
    except ValueError as e:
        raise t.fail(f"bind() refused the kit's model ({MOE_LAYERS} layers, {MOE_EXPERTS} experts, "
                     f"top-{MOE_TOPK}) with the example parameters: {e}; give example parameters "
                     "that fit it (marker params=)") from None
    results = []
    for layer in range(MOE_LAYERS):
        for renorm in (True, False):
            g = torch.Generator().manual_seed(500 + layer * 2 + renorm)
            logits = torch.randn(MOE_TOKENS, MOE_EXPERTS, generator=g).to(_dtype(dtype))
            before = logits.clone()
            label = f"layer {layer} renormalize={renorm} {dtype}"
            out: dict[str, Any] = {}
            adjusted = impl.adjust_logits(layer, logits) if cls.implements("adjust_logits") else logits
            if rules and (adjusted.shape != logits.shape or adjusted.dtype != logits.dtype):
                raise t.fail(f"adjust_logits returned {tuple(adjusted.shape)} {adjusted.dtype} for "
                             f"{tuple(logits.shape)} {logits.dtype} ({label})")
            if rules and not torch.equal(logits, before):
                raise t.fail(f"adjust_logits modified the router logits in place ({label})")
            if rules and lossless and not torch.equal(adjusted, logits):
                raise t.fail(f"declared lossless but adjust_logits changed the logits ({label})")
            out["logits"] = adjusted
            if cls.implements("route"):
                w, ids = impl.route(layer, adjusted, MOE_TOPK, renorm)
                if rules:
                    if tuple(w.shape) != (MOE_TOKENS, MOE_TOPK) or tuple(ids.shape) != (MOE_TOKENS, MOE_TOPK):
                        raise t.fail(f"route returned weights {tuple(w.shape)} and ids {tuple(ids.shape)}; "
                                     f"both must be [T, top_k] = [{MOE_TOKENS}, {MOE_TOPK}] ({label})")
                    if ids.is_floating_point() or ids.min() < 0 or ids.max() >= MOE_EXPERTS:
                        raise t.fail(f"route returned expert ids outside [0, {MOE_EXPERTS}) ({label})")
                    wf = w.float()
                    if not torch.isfinite(wf).all() or (wf < 0).any():
                        raise t.fail(f"route returned negative or non-finite weights ({label})")
                    if ((wf > 0).sum(-1) < 1).any():
                        raise t.fail(f"route left a token with no expert (all weights 0) ({label})")
                    if renorm and ((wf.sum(-1) - 1).abs() > 1e-3).any():
                        raise t.fail(f"with renormalize each token's weights must sum to 1 ({label})")
                    if lossless:
                        rw, rids = model_topk(logits, MOE_TOPK, renorm)
                        if not (torch.equal(ids.long().sort(-1).values, rids.sort(-1).values)
                                and torch.allclose(wf.sort(-1).values, rw.sort(-1).values, atol=1e-3)):
                            raise t.fail(f"declared lossless but routes differently from the "
                                         f"model's top-k ({label})")
                out["route"] = (w, ids)
            else:
                w, ids = model_topk(adjusted, MOE_TOPK, renorm)
            if cls.implements("observe"):
                wc, ic = w.clone(), ids.clone()
                impl.observe(layer, ids, w)
                if rules and not (torch.equal(w, wc) and torch.equal(ids, ic)):
                    raise t.fail(f"observe modified the routing in place ({label})")
            results.append((label, out))
    return results


EXERCISES: dict[Kind, Callable[[Target, Any, str, bool], list[tuple[str, Any]]]] = {
    Kind.ATTENTION: exercise_attention,
    Kind.KVCOMPRESS: exercise_kvcompress,
    Kind.SPECULATIVE: exercise_speculative,
    Kind.QUANT: exercise_quant,
    Kind.MOE: exercise_moe,
}


def _dtypes(t: Target) -> list[str]:
    """The dtypes to exercise: float32 and float16 where declared; bfloat16 only for a plugin
    that declares nothing else (the Triton interpreter's bf16 is unreliable)."""
    declared = t.entry.registration.capabilities.dtypes
    chosen = [d for d in ("float32", "float16") if d in declared]
    return chosen or [d for d in declared if d == "bfloat16"] or ["float32"]


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
    torch = _torch()
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            raise ValueError(f"{where}: shapes differ ({getattr(a, 'shape', a)} vs {getattr(b, 'shape', b)})")
        if not a.is_floating_point():
            if not torch.equal(a, b):
                raise ValueError(f"{where}: integer tensors differ")
            return 0.0
        err = _max_err(a, b)
        scale = max(b.float().abs().max().item(), 1.0) if b.numel() else 1.0
        if not math.isfinite(err) or err > _tol(dtype) * 10 * scale:
            raise ValueError(f"{where}: max|diff| {err:.3g} (tolerance {_tol(dtype) * 10 * scale:.3g})")
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
    torch = _torch()
    if torch.cuda.is_available():
        return None
    return ("no GPU and TRITON_INTERPRET is not 1 (the pytest plugin sets it when a conformance "
            "test is collected; set it before triton is imported)")


def check_parity(t: Target) -> str:
    params = t.entry.registration.params
    if KERNEL_FIELD not in params.model_fields:
        raise Skipped(f"no '{KERNEL_FIELD}' parameter, so the kit cannot switch the plugin to a "
                      "Triton path (derive its parameters from vllm_graft.hooks.KernelParams when it "
                      "has one)")
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
    from vllm_graft.kit.conformance.engine import run_engine_check

    return run_engine_check(t)


CHECKS: list[Check] = [
    Check("registration", "registration fields; impl imports, builds and describes itself",
          check_registration),
    Check("params-roundtrip", "the parameter model survives JSON", check_params_roundtrip),
    Check("params-reject", "unknown fields, wrong types and out-of-bound values are refused",
          check_params_reject),
    Check("contract", "the reference path keeps the kind's rules on generated inputs", check_contract),
    Check("parity", "Triton kernels match the reference (TRITON_INTERPRET=1)", check_parity),
    Check("state", "nothing of a request is held after finish()", check_state,
          kinds=(Kind.SPECULATIVE,)),  # the one kind told when a request ends
    Check("engine", "in vLLM's CPU engine; lossless = plain vLLM's greedy tokens", check_engine,
          engine=True),
]
