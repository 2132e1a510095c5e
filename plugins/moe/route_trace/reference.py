"""The route-trace scheduler (:class:`RouteTrace`, an ``observe`` step into a :class:`Recorder`)
and the routing traces it records: which experts every token used in every MoE layer, as
recorded in vLLM.

A :class:`Trace` holds, for ``N`` tokens (in the order the engine ran them: every forward
step's tokens packed, steps in order) and the model's MoE layers:

* ``ids [L, N, k]`` (int16): the experts each token was routed to in each MoE layer;
* ``weights [L, N, k]`` (float16, optional): their routing weights (0 = an unused slot, e.g.
  an expert pruned by dynamic top-k);
* ``steps [S]``: tokens per forward step (they sum to ``N``); token ``n`` of layer ``l`` and
  token ``n`` of layer ``l+1`` are the same token;
* ``segments``: named token ranges (e.g. one per bench workload), for fit/evaluate splits.

Saved as a compressed ``.npz`` (4 layers x 100K tokens x top-2 is ~1 MB). Pure NumPy (no torch).
"""

from __future__ import annotations

import atexit
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ....hooks import MoEModel, MoEScheduler

FORMAT = "vllm-graft/routing-trace"
VERSION = 1


class TraceError(ValueError):
    pass


@dataclass
class Trace:
    ids: np.ndarray  # [L, N, k] int16
    layers: list[int]  # decoder-layer index of each row
    num_experts: int
    steps: np.ndarray  # [S] int64, sums to N
    weights: np.ndarray | None = None  # [L, N, k] float16
    segments: list[tuple[str, int, int]] = field(default_factory=list)  # (name, start, end) tokens
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ids.ndim != 3:
            raise TraceError(f"ids must be [layers, tokens, k], got shape {self.ids.shape}")
        L, N, _ = self.ids.shape
        if len(self.layers) != L:
            raise TraceError(f"{len(self.layers)} layer indices for {L} layers of ids")
        if int(np.sum(self.steps)) != N:
            raise TraceError(f"steps sum to {int(np.sum(self.steps))}, not the {N} tokens")
        if self.weights is not None and self.weights.shape != self.ids.shape:
            raise TraceError(f"weights {self.weights.shape} and ids {self.ids.shape} differ in shape")
        if N and (self.ids.min() < 0 or self.ids.max() >= self.num_experts):
            raise TraceError(f"expert ids outside 0..{self.num_experts - 1}")

    # ------------------------------------------------------------------- shape
    @property
    def num_layers(self) -> int:
        return self.ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[1]

    @property
    def top_k(self) -> int:
        return self.ids.shape[2]

    def active(self) -> np.ndarray:
        """``[L, N, k]`` bool: the slots that carry weight (all of them without weights)."""
        if self.weights is None:
            return np.ones(self.ids.shape, dtype=bool)
        return self.weights.astype(np.float32) > 0

    def token_sets(self) -> np.ndarray:
        """``[L, N, E]`` bool: expert ``e`` was used (with weight) by token ``n`` in layer ``l``."""
        L, N, k = self.ids.shape
        out = np.zeros((L, N, self.num_experts), dtype=bool)
        act = self.active()
        li, ni, ki = np.nonzero(act)
        out[li, ni, self.ids[li, ni, ki]] = True
        return out

    def counts(self) -> np.ndarray:
        """``[L, E]`` tokens routed to each expert (slots with weight)."""
        return self.token_sets().sum(axis=1)

    def select(self, start: int, end: int) -> "Trace":
        """Tokens ``start:end`` (step sizes recomputed; segments clipped)."""
        bounds = np.concatenate([[0], np.cumsum(self.steps)])
        steps = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            lo, hi = max(a, start), min(b, end)
            if hi > lo:
                steps.append(hi - lo)
        segs = [
            (n, max(a, start) - start, min(b, end) - start) for n, a, b in self.segments if min(b, end) > max(a, start)
        ]
        return Trace(
            self.ids[:, start:end],
            list(self.layers),
            self.num_experts,
            np.asarray(steps, dtype=np.int64),
            None if self.weights is None else self.weights[:, start:end],
            segs,
            dict(self.meta),
        )

    def segment(self, name: str) -> "Trace":
        for n, a, b in self.segments:
            if n == name:
                return self.select(a, b)
        raise TraceError(f"no segment {name!r}; segments: {[n for n, _, _ in self.segments]}")

    def split(self, fraction: float) -> tuple["Trace", "Trace"]:
        """``(first, rest)``: the first ``fraction`` of every segment (or of the whole trace
        without segments) and the rest, for fitting a policy on one part and evaluating it on
        the other."""
        if not 0 < fraction < 1:
            raise ValueError(f"fraction must be in (0, 1), got {fraction}")
        segs = self.segments or [("all", 0, self.num_tokens)]
        fit, held = [], []
        for name, a, b in segs:
            cut = a + int(round((b - a) * fraction))
            fit.append(self.select(a, cut)._renamed(name))
            held.append(self.select(cut, b)._renamed(name))
        return concat(fit), concat(held)

    def _renamed(self, name: str) -> "Trace":
        self.segments = [(name, 0, self.num_tokens)]
        return self

    # ------------------------------------------------------------------- files
    def save(self, path: str | Path) -> None:
        arrays = {
            "ids": self.ids.astype(np.int16),
            "steps": self.steps.astype(np.int64),
            "layers": np.asarray(self.layers, dtype=np.int64),
        }
        if self.weights is not None:
            arrays["weights"] = self.weights.astype(np.float16)
        header = {
            "format": FORMAT,
            "version": VERSION,
            "num_experts": self.num_experts,
            "segments": [list(s) for s in self.segments],
            "meta": self.meta,
        }
        arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
        with open(path, "wb") as f:
            np.savez_compressed(f, **arrays)

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        try:
            with np.load(path, allow_pickle=False) as z:
                header = json.loads(bytes(z["header"]).decode())
                if header.get("format") != FORMAT:
                    raise TraceError(f"{path} is not a routing trace ({header.get('format')!r})")
                return cls(
                    z["ids"].astype(np.int16),
                    [int(x) for x in z["layers"]],
                    int(header["num_experts"]),
                    z["steps"].astype(np.int64),
                    z["weights"] if "weights" in z else None,
                    [(str(n), int(a), int(b)) for n, a, b in header.get("segments", [])],
                    header.get("meta", {}),
                )
        except (OSError, KeyError, ValueError) as e:
            if isinstance(e, TraceError):
                raise
            raise TraceError(f"cannot read routing trace {path}: {e}") from None


def concat(traces: Sequence[Trace]) -> Trace:
    """One trace after another (same layers, experts and top-k)."""
    traces = [t for t in traces if t.num_tokens or t.segments]
    if not traces:
        raise TraceError("nothing to concatenate")
    first = traces[0]
    for t in traces[1:]:
        if t.layers != first.layers or t.num_experts != first.num_experts or t.top_k != first.top_k:
            raise TraceError("traces of different models (layers, experts or top-k differ)")
    segs, offset = [], 0
    for t in traces:
        segs += [(n, a + offset, b + offset) for n, a, b in t.segments]
        offset += t.num_tokens
    weights = None
    if all(t.weights is not None for t in traces):
        weights = np.concatenate([t.weights for t in traces], axis=1)
    return Trace(
        np.concatenate([t.ids for t in traces], axis=1),
        list(first.layers),
        first.num_experts,
        np.concatenate([t.steps for t in traces]),
        weights,
        segs,
        dict(first.meta),
    )


class Recorder:
    """Collects ``observe`` calls into a :class:`Trace` (used by the route-trace plugin).

    One forward step calls every MoE layer once, with the same tokens; the recorder checks
    that, and counts a step each time the first layer it saw comes round again.
    """

    def __init__(self, max_tokens: int = 2_000_000, keep_weights: bool = True) -> None:
        self.max_tokens = max_tokens
        self.keep_weights = keep_weights
        self.reset()

    def reset(self) -> None:
        self._ids: dict[int, list[np.ndarray]] = {}
        self._w: dict[int, list[np.ndarray]] = {}
        self._steps: list[int] = []
        self._segments: list[tuple[str, int, int]] = []
        self._segment: tuple[str, int] | None = None
        self.num_experts = 0
        self.tokens = 0
        self.dropped = 0
        self.full = False

    def begin_segment(self, name: str) -> None:
        self.end_segment()
        self._segment = (name, self.tokens)

    def end_segment(self) -> None:
        if self._segment is not None:
            name, start = self._segment
            self._segments.append((name, start, self.tokens))
            self._segment = None

    def add(self, layer: int, ids: np.ndarray, weights: np.ndarray | None, num_experts: int | None = None) -> None:
        T = ids.shape[0]
        if num_experts:
            self.num_experts = max(self.num_experts, num_experts)
        if self._ids and layer == next(iter(self._ids)) or not self._ids:
            # a new forward step begins at the first layer seen
            if self.full or self.tokens + T > self.max_tokens:
                self.full = True
                self.dropped += T
                return
            self._steps.append(T)
            self.tokens += T
        elif self.full and len(self._ids[next(iter(self._ids))]) == len(self._ids.get(layer, [])):
            return  # this step was dropped at its first layer
        self._ids.setdefault(layer, []).append(ids.astype(np.int16, copy=False))
        if self.keep_weights and weights is not None:
            self._w.setdefault(layer, []).append(weights.astype(np.float16, copy=False))

    def trace(self, num_experts: int | None = None, meta: dict[str, Any] | None = None) -> Trace:
        self.end_segment()
        layers = sorted(self._ids)
        if not layers:
            raise TraceError("nothing was recorded (no MoE layer ran with the recorder)")
        per = [np.concatenate(self._ids[l]) if self._ids[l] else np.zeros((0, 1), np.int16) for l in layers]
        n = {p.shape[0] for p in per}
        if len(n) != 1:
            raise TraceError(f"layers saw different token counts {sorted(n)}: an incomplete step?")
        w = None
        if self.keep_weights and set(self._w) == set(layers):
            w = np.stack([np.concatenate(self._w[l]) for l in layers])
        E = num_experts or self.num_experts or int(max(p.max() for p in per)) + 1
        return Trace(
            np.stack(per), layers, E, np.asarray(self._steps, dtype=np.int64), w, list(self._segments), dict(meta or {})
        )


class RouteTrace(MoEScheduler):
    def __init__(self, params) -> None:
        super().__init__(params)
        self.recorder = Recorder(params.max_tokens, params.weights)
        self.model: MoEModel | None = None
        if params.path:
            atexit.register(self._save_at_exit)

    def bind(self, model: MoEModel) -> None:
        self.model = model

    def observe(self, layer_idx, topk_ids, topk_weights):
        E = self.model.num_experts if self.model is not None else None
        self.recorder.add(layer_idx, topk_ids.detach().cpu().numpy(), topk_weights.detach().float().cpu().numpy(), E)

    # ------------------------------------------------------------ for the tools
    def reset(self) -> None:
        self.recorder.reset()

    def trace(self, meta: dict[str, Any] | None = None) -> Trace:
        E = self.model.num_experts if self.model is not None else None
        info = {"model": self.model.model if self.model else None, **(meta or {})}
        return self.recorder.trace(E, info)

    def save(self, path: str | os.PathLike[str] | None = None) -> str:
        path = str(path or self.params.path)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.trace().save(path)
        return path

    def _save_at_exit(self) -> None:
        if self.recorder.tokens:
            try:
                self.save()
            except Exception:  # noqa: BLE001 - at exit there is no one to tell but stderr
                import traceback

                traceback.print_exc()

    def describe(self) -> dict[str, Any]:
        r = self.recorder
        return {"tokens_recorded": r.tokens, "steps": len(r._steps), "dropped_tokens": r.dropped}
