"""Expert masks (MoTE): which experts each MoE layer switches off or forces on.

Pure Python: the mask, its file format, its validation against a model, and the calibration
that picks the experts most distinctive for a behaviour. No tensors (see ``reference.py``).

File format (JSON, written by ``vllm-graft calibrate expert-mask``)::

    {"format": "vllm-graft/expert-mask", "version": 1,
     "num_layers": 4, "num_experts": 8,          # the model it was made for (checked if given)
     "off": {"0": [3], "2": [1, 5]},             # decoder layer -> experts switched off
     "on":  {"1": [6]},                          # decoder layer -> experts forced into the top-k
     "calibration": {...}}                       # how it was made (free form, optional)

A layer key ``"*"`` means every MoE layer.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

FORMAT = "vllm-graft/expert-mask"
VERSION = 1
ALL = "*"


class MaskError(ValueError):
    """A mask that is malformed or does not fit the model (the message says which entry)."""


def _parse_layers(raw: Mapping[Any, Any] | None, what: str) -> dict[int | str, frozenset[int]]:
    out: dict[int | str, frozenset[int]] = {}
    for key, experts in (raw or {}).items():
        if key == ALL:
            layer: int | str = ALL
        else:
            try:
                layer = int(key)
                if isinstance(key, bool) or str(layer) != str(key).strip() or layer < 0:
                    raise ValueError
            except (TypeError, ValueError):
                raise MaskError(
                    f"{what}: layer key {key!r} is not a layer index (an int >= 0) or {ALL!r} (every layer)"
                ) from None
        if isinstance(experts, (str, bytes)) or not isinstance(experts, Sequence | set | frozenset):
            raise MaskError(f"{what}[{key!r}]: expected a list of expert indices, got {experts!r}")
        ids = []
        for e in experts:
            if isinstance(e, bool) or not isinstance(e, int) or e < 0:
                raise MaskError(f"{what}[{key!r}]: {e!r} is not an expert index (an int >= 0)")
            ids.append(e)
        out[layer] = out.get(layer, frozenset()) | frozenset(ids)
    return out


@dataclass(frozen=True)
class ExpertMask:
    """Per layer: experts switched off and experts forced on (layer ``"*"``: every layer)."""

    off: Mapping[int | str, frozenset[int]] = field(default_factory=dict)
    on: Mapping[int | str, frozenset[int]] = field(default_factory=dict)
    num_layers: int | None = None  # the model the mask was made for, when known
    num_experts: int | None = None
    calibration: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "mask") -> "ExpertMask":
        if not isinstance(data, Mapping):
            raise MaskError(f"{source}: expected a JSON object, got {type(data).__name__}")
        fmt = data.get("format", FORMAT)
        if fmt != FORMAT:
            raise MaskError(f"{source}: format {fmt!r} is not {FORMAT!r}")
        if data.get("version", VERSION) != VERSION:
            raise MaskError(f"{source}: version {data.get('version')!r} not supported (only {VERSION})")
        unknown = sorted(set(data) - {"format", "version", "num_layers", "num_experts", "off", "on", "calibration"})
        if unknown:
            raise MaskError(
                f"{source}: unknown field(s) {unknown}; accepted: format, version, "
                "num_layers, num_experts, off, on, calibration"
            )
        for k in ("num_layers", "num_experts"):
            v = data.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise MaskError(f"{source}: {k} must be a positive int, got {v!r}")
        return cls(
            _parse_layers(data.get("off"), f"{source}: off"),
            _parse_layers(data.get("on"), f"{source}: on"),
            data.get("num_layers"),
            data.get("num_experts"),
            dict(data.get("calibration") or {}),
        )

    @classmethod
    def load(cls, path: str | Path) -> "ExpertMask":
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise MaskError(f"cannot read mask file {path}: {e.strerror or e}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise MaskError(f"mask file {path} is not JSON: {e}") from None
        return cls.from_dict(data, f"mask file {path}")

    def to_dict(self) -> dict[str, Any]:
        def side(m: Mapping[int | str, frozenset[int]]) -> dict[str, list[int]]:
            keys = sorted(m, key=lambda k: (k != ALL, k if isinstance(k, int) else -1))
            return {str(k): sorted(m[k]) for k in keys if m[k]}

        out: dict[str, Any] = {"format": FORMAT, "version": VERSION}
        if self.num_layers is not None:
            out["num_layers"] = self.num_layers
        if self.num_experts is not None:
            out["num_experts"] = self.num_experts
        out["off"], out["on"] = side(self.off), side(self.on)
        if self.calibration:
            out["calibration"] = dict(self.calibration)
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    def merged(self, other: "ExpertMask") -> "ExpertMask":
        """Both masks at once (union of switched-off and of forced-on experts)."""

        def union(a, b):
            return {k: a.get(k, frozenset()) | b.get(k, frozenset()) for k in set(a) | set(b)}

        return ExpertMask(
            union(self.off, other.off),
            union(self.on, other.on),
            self.num_layers or other.num_layers,
            self.num_experts or other.num_experts,
            {**other.calibration, **self.calibration},
        )

    # ----------------------------------------------------------------------- queries
    def off_in(self, layer: int) -> frozenset[int]:
        return self.off.get(ALL, frozenset()) | self.off.get(layer, frozenset())

    def on_in(self, layer: int) -> frozenset[int]:
        return self.on.get(ALL, frozenset()) | self.on.get(layer, frozenset())

    @property
    def empty(self) -> bool:
        return not any(self.off.values()) and not any(self.on.values())

    def layers_named(self) -> set[int]:
        return {k for k in (*self.off, *self.on) if isinstance(k, int)}

    def problems(
        self, num_layers: int, num_experts: int, top_k: int, moe_layers: Sequence[int] | None = None
    ) -> list[str]:
        """What does not fit a model with these facts (empty: the mask fits)."""
        out = []
        layers = list(moe_layers) if moe_layers is not None else list(range(num_layers))
        if self.num_experts is not None and self.num_experts != num_experts:
            out.append(f"the mask was made for a model with {self.num_experts} experts, this one has {num_experts}")
        if self.num_layers is not None and self.num_layers != num_layers:
            out.append(f"the mask was made for a model with {self.num_layers} layers, this one has {num_layers}")
        bad_layers = sorted(k for k in self.layers_named() if k not in layers)
        if bad_layers:
            out.append(
                f"layer(s) {bad_layers} do not exist or have no MoE block; MoE layers: "
                f"{_ranges(layers)} (or {ALL!r} for all)"
            )
        for side, m in (("off", self.off), ("on", self.on)):
            for k, experts in sorted(m.items(), key=lambda kv: str(kv[0])):
                bad = sorted(e for e in experts if e >= num_experts)
                if bad:
                    out.append(f"{side}[{str(k)!r}]: expert(s) {bad} out of range; experts are 0..{num_experts - 1}")
        for layer in layers:
            off, on = self.off_in(layer), self.on_in(layer)
            both = sorted(off & on)
            if both:
                out.append(f"layer {layer}: expert(s) {both} are both switched off and forced on")
            if len(on) > top_k:
                out.append(
                    f"layer {layer}: {len(on)} experts forced on ({sorted(on)}) but a token takes only top-{top_k}"
                )
            left = num_experts - len({e for e in off if e < num_experts})
            if left < top_k:
                out.append(
                    f"layer {layer}: {num_experts - left} of {num_experts} experts switched off "
                    f"leaves {left}, fewer than the top-{top_k} each token needs"
                )
        return out

    def check(self, num_layers: int, num_experts: int, top_k: int, moe_layers: Sequence[int] | None = None) -> None:
        found = self.problems(num_layers, num_experts, top_k, moe_layers)
        if found:
            raise MaskError("; ".join(found))


def _ranges(layers: Sequence[int]) -> str:
    layers = sorted(layers)
    if layers and layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}..{layers[-1]}"
    return str(layers)


# -------------------------------------------------------------------------- calibration
@dataclass(frozen=True)
class Distinctive:
    layer: int
    expert: int
    freq_a: float  # share of behaviour-A tokens routed to this expert (0..1)
    freq_b: float  # same for the contrast set B
    score: float  # the contrast the experts are ranked by


def activation_frequency(counts: Sequence[Sequence[int]], num_tokens: int) -> list[list[float]]:
    """``counts[layer][expert]`` (tokens routed there) -> share of the ``num_tokens`` tokens."""
    if num_tokens <= 0:
        raise ValueError("no tokens were routed: cannot compute activation frequencies")
    return [[c / num_tokens for c in row] for row in counts]


def contrast(
    freq_a: Sequence[Sequence[float]], freq_b: Sequence[Sequence[float]], *, method: str = "diff", eps: float = 1e-3
) -> list[list[float]]:
    """Per layer and expert, how much more behaviour A uses it than B.

    ``diff``: ``f_A - f_B`` (MoTE's activation-frequency contrast); ``log-ratio``:
    ``log((f_A + eps) / (f_B + eps))`` (favours rarely used experts that A alone uses).
    """
    if len(freq_a) != len(freq_b) or any(len(a) != len(b) for a, b in zip(freq_a, freq_b)):
        raise ValueError("the two frequency tables have different shapes")
    if method == "diff":
        return [[a - b for a, b in zip(ra, rb)] for ra, rb in zip(freq_a, freq_b)]
    if method == "log-ratio":
        return [[math.log((a + eps) / (b + eps)) for a, b in zip(ra, rb)] for ra, rb in zip(freq_a, freq_b)]
    raise ValueError(f"unknown contrast {method!r}; accepted: diff, log-ratio")


def most_distinctive(
    freq_a: Sequence[Sequence[float]],
    freq_b: Sequence[Sequence[float]],
    *,
    top: int,
    per_layer: bool = False,
    method: str = "diff",
    min_score: float = 0.0,
    layers: Sequence[int] | None = None,
    max_per_layer: int | None = None,
) -> list[Distinctive]:
    """The ``top`` (layer, expert) pairs with the largest contrast above ``min_score``, best
    first (``per_layer``: ``top`` in every layer). ``max_per_layer`` caps how many one layer
    may give (so a mask built from them leaves enough experts). ``layers[i]`` is the decoder
    layer of row i (default: i)."""
    scores = contrast(freq_a, freq_b, method=method)
    layer_ids = list(layers) if layers is not None else list(range(len(scores)))
    cands = [
        Distinctive(layer_ids[i], e, freq_a[i][e], freq_b[i][e], s)
        for i, row in enumerate(scores)
        for e, s in enumerate(row)
        if s > min_score
    ]
    cands.sort(key=lambda d: (-d.score, d.layer, d.expert))
    taken: dict[int, int] = {}
    out: list[Distinctive] = []
    for d in cands:
        cap = top if per_layer else (max_per_layer if max_per_layer is not None else math.inf)
        if per_layer and max_per_layer is not None:
            cap = min(cap, max_per_layer)
        if taken.get(d.layer, 0) >= cap:
            continue
        if not per_layer and len(out) >= top:
            break
        taken[d.layer] = taken.get(d.layer, 0) + 1
        out.append(d)
    return out


def mask_from(
    chosen: Sequence[Distinctive],
    action: str,
    num_layers: int,
    num_experts: int,
    calibration: Mapping[str, Any] | None = None,
) -> ExpertMask:
    """A mask switching the chosen experts off (``action='off'``) or forcing them on."""
    if action not in ("off", "on"):
        raise ValueError(f"unknown action {action!r}; accepted: off, on")
    per: dict[int | str, frozenset[int]] = {}
    for d in chosen:
        per[d.layer] = per.get(d.layer, frozenset()) | {d.expert}
    kw = {action: per}
    return ExpertMask(**kw, num_layers=num_layers, num_experts=num_experts, calibration=dict(calibration or {}))
