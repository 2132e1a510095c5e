"""Affinity-aware expert placement (ExFlow), pure NumPy.

Inter-layer affinity: ``A[l, i, j]`` counts the tokens that used expert ``i`` in MoE layer
``l`` and expert ``j`` in layer ``l+1`` (from a routing trace; slots of weight 0 excluded).

Cost model (what "all-to-all volume" means here): with expert parallelism over ``N`` devices a
token's hidden state goes from the devices of its layer-``l`` experts to those of its
layer-``l+1`` experts; every (layer-``l`` expert, layer-``l+1`` expert) pair of a token on
different devices is one cross-device transfer of a hidden vector. The volume of a placement is
``sum_l sum_ij A[l,i,j] * [dev_l(i) != dev_{l+1}(j)]`` (the first layer's dispatch from the
attention rank is the same for every placement in expectation and is left out). Co-locating
experts with high affinity (ExFlow) lowers it.

A placement gives every layer's experts to ``N`` devices, ``E/N`` each (a balanced partition).
Baselines as vLLM names them (``expert_placement_strategy``): ``linear`` (expert ``e`` on
device ``e // (E/N)``) and ``round_robin`` (``e % N``), the same in every layer.

Solvers: the cost is a chain over layers, so it is solved exactly by dynamic programming over
the labelled balanced partitions of one layer when there are few (E=8: 70 for N=2, 2520 for
N=4); with one expert per device (N=E) each boundary is an independent assignment problem
(exact, Hungarian); otherwise a heuristic: layer-by-layer balanced assignment to the previous
layer's devices, then pairwise-swap local search. A lower bound is always computed: an expert
can share its device with at most ``E/N`` experts of the next layer, so per boundary at most
``sum_i (its E/N largest affinities)`` (and the same by columns) can stay on-device.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

FORMAT = "vllm-graft/expert-placement"


# ------------------------------------------------------------------------------ affinity
def affinity(sets: np.ndarray) -> np.ndarray:
    """``sets [L, N, E]`` bool (token n used expert e in layer l) -> ``A [L-1, E, E]`` counts."""
    s: np.ndarray = sets.astype(np.float64)
    return np.einsum("lni,lnj->lij", s[:-1], s[1:])


# ----------------------------------------------------------------------------- placement
@dataclass(frozen=True)
class Placement:
    devices: np.ndarray  # [L, E] int: the device of each layer's expert
    num_devices: int
    name: str = ""

    def problems(self, capacity: int | None = None) -> list[str]:
        """Why this is not a valid placement (empty: valid): every expert of every layer on
        exactly one device in range, no device over ``capacity`` (default ceil(E/N))."""
        out = []
        L, E = self.devices.shape
        cap = capacity if capacity is not None else math.ceil(E / self.num_devices)
        if ((self.devices < 0) | (self.devices >= self.num_devices)).any():
            out.append(f"device ids outside 0..{self.num_devices - 1}")
        for l in range(L):
            counts = np.bincount(self.devices[l].clip(0, self.num_devices - 1), minlength=self.num_devices)
            if counts.max() > cap:
                out.append(f"layer {l}: a device holds {counts.max()} experts, capacity {cap}")
        return out

    def members(self, layer: int) -> list[list[int]]:
        return [sorted(np.nonzero(self.devices[layer] == d)[0].tolist()) for d in range(self.num_devices)]

    def to_vllm(self, layers: Sequence[int]) -> dict[str, Any]:
        """The placement in vLLM's expert-parallel terms (``vllm.distributed.eplb``):
        ``physical_to_logical_map[l][p]`` is the logical expert in physical slot ``p``, where EP
        rank ``r`` holds the slots ``r*E/N .. (r+1)*E/N - 1`` (EplbState's layout, no redundant
        experts); ``expert_map[r][l][e]`` is expert ``e``'s local index on rank ``r``, or -1
        (``determine_expert_map``'s layout, per layer)."""
        L, E = self.devices.shape
        p2l, maps = [], [[[-1] * E for _ in range(L)] for _ in range(self.num_devices)]
        for l in range(L):
            row = []
            for r, experts in enumerate(self.members(l)):
                for local, e in enumerate(experts):
                    maps[r][l][e] = local
                row += experts
            p2l.append(row)
        return {
            "format": FORMAT,
            "version": 1,
            "num_devices": self.num_devices,
            "num_experts": E,
            "moe_layers": list(layers),
            "name": self.name,
            "physical_to_logical_map": p2l,
            "expert_map": maps,
        }

    @classmethod
    def from_vllm(cls, data: dict[str, Any]) -> "Placement":
        if data.get("format") != FORMAT:
            raise ValueError(f"not an expert placement (format {data.get('format')!r}, want {FORMAT!r})")
        n, E = int(data["num_devices"]), int(data["num_experts"])
        p2l = np.asarray(data["physical_to_logical_map"], dtype=np.int64)
        if p2l.ndim != 2 or p2l.shape[1] != E or sorted(p2l[0].tolist()) != list(range(E)):
            raise ValueError("physical_to_logical_map must list every expert once per layer")
        per = E // n
        dev = np.zeros_like(p2l)
        for l in range(p2l.shape[0]):
            if sorted(p2l[l].tolist()) != list(range(E)):
                raise ValueError(f"layer {l}: physical_to_logical_map is not a permutation of 0..{E - 1}")
            dev[l, p2l[l]] = np.arange(E) // per
        return cls(dev, n, str(data.get("name", "")))

    def save(self, path: str | Path, layers: Sequence[int], extra: dict[str, Any] | None = None) -> None:
        Path(path).write_text(json.dumps({**self.to_vllm(layers), **(extra or {})}, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Placement":
        try:
            return cls.from_vllm(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"cannot read placement file {path}: {e}") from None


def _check(E: int, N: int) -> None:
    if N < 1 or E % N:
        raise ValueError(f"{E} experts do not split evenly over {N} devices")


def linear(L: int, E: int, N: int) -> Placement:
    _check(E, N)
    return Placement(np.tile(np.arange(E) // (E // N), (L, 1)), N, "linear")


def round_robin(L: int, E: int, N: int) -> Placement:
    _check(E, N)
    return Placement(np.tile(np.arange(E) % N, (L, 1)), N, "round_robin")


def volume(A: np.ndarray, p: Placement) -> float:
    """Cross-device transfers of ``p`` under affinity ``A`` (see the module docstring)."""
    total = 0.0
    for l in range(A.shape[0]):
        cross = p.devices[l][:, None] != p.devices[l + 1][None, :]
        total += float((A[l] * cross).sum())
    return total


def lower_bound(A: np.ndarray, N: int) -> float:
    """No balanced placement on ``N`` devices has a smaller volume than this."""
    E = A.shape[1]
    c = E // N
    lb = 0.0
    for l in range(A.shape[0]):
        rows = np.sort(A[l], axis=1)[:, ::-1][:, :c].sum()
        cols = np.sort(A[l], axis=0)[::-1, :][:c, :].sum()
        lb += float(A[l].sum() - min(rows, cols))
    return lb


# -------------------------------------------------------------------------------- solvers
def _labelled_partitions(E: int, N: int) -> np.ndarray:
    """Every assignment of E experts to N devices with E/N each: ``[P, E]`` device ids."""
    c = E // N
    out = []

    def rec(prefix: list[int], counts: list[int]) -> None:
        if len(prefix) == E:
            out.append(list(prefix))
            return
        for d in range(N):
            if counts[d] < c:
                counts[d] += 1
                prefix.append(d)
                rec(prefix, counts)
                prefix.pop()
                counts[d] -= 1

    rec([], [0] * N)
    return np.asarray(out, dtype=np.int64)


def num_labelled_partitions(E: int, N: int) -> int:
    c = E // N
    return math.factorial(E) // math.factorial(c) ** N


def hungarian(cost: np.ndarray) -> np.ndarray:
    """Minimum-cost perfect matching of a square matrix: ``col[i]`` for each row ``i``
    (Jonker-Volgenant style shortest augmenting paths, O(n^3))."""
    n = cost.shape[0]
    INF = float("inf")
    u, v = np.zeros(n + 1), np.zeros(n + 1)
    p, way = np.zeros(n + 1, dtype=np.int64), np.zeros(n + 1, dtype=np.int64)
    for i in range(1, n + 1):
        p[0] = i
        j0 = 0
        minv = np.full(n + 1, INF)
        used = np.zeros(n + 1, dtype=bool)
        while True:
            used[j0] = True
            i0 = p[j0]
            delta, j1 = INF, 0
            for j in range(1, n + 1):
                if not used[j]:
                    cur = cost[i0 - 1, j - 1] - u[i0] - v[j]
                    if cur < minv[j]:
                        minv[j], way[j] = cur, j0
                    if minv[j] < delta:
                        delta, j1 = minv[j], j
            for j in range(n + 1):
                if used[j]:
                    u[p[j]] += delta
                    v[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
            if p[j0] == 0:
                break
        while True:
            j1 = way[j0]
            p[j0] = p[j1]
            j0 = j1
            if j0 == 0:
                break
    col = np.zeros(n, dtype=np.int64)
    for j in range(1, n + 1):
        col[p[j] - 1] = j - 1
    return col


def _exact_dp(A: np.ndarray, N: int) -> Placement:
    L, E = A.shape[0] + 1, A.shape[1]
    parts = _labelled_partitions(E, N)  # [P, E]
    onehot = np.eye(N)[parts]  # [P, E, N]
    Qt = onehot.transpose(0, 2, 1).reshape(len(parts), -1)  # [P, N*E]: Q_q[j, d] as [d, j]
    best = np.zeros(len(parts))
    back = []
    for l in range(L - 1):
        X = np.einsum("pen,ej->pnj", onehot, A[l]).reshape(len(parts), -1)  # (P^T A) [P, N*E]
        coloc = X @ Qt.T  # [P(prev), P(next)]
        scores = best[:, None] + coloc
        arg = scores.argmax(axis=0)
        best = scores[arg, np.arange(len(parts))]
        back.append(arg)
    q = int(best.argmax())
    seq = [q]
    for arg in reversed(back):
        q = int(arg[q])
        seq.append(q)
    seq.reverse()
    return Placement(parts[seq], N, "affinity (exact)")


def _exact_matching(A: np.ndarray, N: int) -> Placement:
    L, E = A.shape[0] + 1, A.shape[1]
    dev = np.zeros((L, E), dtype=np.int64)
    dev[0] = np.arange(E)
    for l in range(L - 1):
        match = hungarian(-A[l])  # layer-l expert i shares a device with layer-(l+1) expert match[i]
        dev[l + 1, match] = dev[l]
    return Placement(dev, N, "affinity (exact)")


def _greedy(A: np.ndarray, N: int, start: Placement | None = None, iters: int = 20) -> Placement:
    L, E = A.shape[0] + 1, A.shape[1]
    c = E // N
    dev = np.zeros((L, E), dtype=np.int64)
    dev[0] = start.devices[0] if start is not None else np.arange(E) // c
    for l in range(L - 1):
        # place layer l+1's experts on the devices of the layer-l experts they follow most:
        # a balanced assignment (each device c slots) = square assignment on expanded slots
        gain = np.stack([A[l][dev[l] == d].sum(axis=0) for d in range(N)], axis=1)  # [E(next), N]
        slots = np.repeat(gain, c, axis=1)  # [E, N*c]
        col = hungarian(-slots)
        dev[l + 1] = col // c
    p = Placement(dev, N, "affinity (heuristic)")
    return _local_search(A, p, iters)


def _local_search(A: np.ndarray, p: Placement, iters: int) -> Placement:
    dev = p.devices.copy()
    L, E = dev.shape
    cur = volume(A, Placement(dev, p.num_devices))
    for _ in range(iters):
        improved = False
        for l in range(L):
            for i, j in itertools.combinations(range(E), 2):
                if dev[l, i] == dev[l, j]:
                    continue
                dev[l, i], dev[l, j] = dev[l, j], dev[l, i]
                v = volume(A, Placement(dev, p.num_devices))
                if v < cur - 1e-9:
                    cur, improved = v, True
                else:
                    dev[l, i], dev[l, j] = dev[l, j], dev[l, i]
        if not improved:
            break
    return Placement(dev, p.num_devices, p.name)


@dataclass
class Solution:
    placement: Placement
    method: str
    volume: float
    lower_bound: float
    info: dict[str, Any] = field(default_factory=dict)


EXACT_DP_LIMIT = 5000  # labelled partitions of one layer the DP handles


def solve(A: np.ndarray, N: int, method: str = "auto") -> Solution:
    """Placement of ``A``'s experts (``[L-1, E, E]``) on ``N`` devices minimising volume."""
    E = A.shape[1]
    _check(E, N)
    lb = lower_bound(A, N)
    if method not in ("auto", "exact", "heuristic"):
        raise ValueError(f"unknown method {method!r}; accepted: auto, exact, heuristic")
    if N == 1:
        p = Placement(np.zeros((A.shape[0] + 1, E), dtype=np.int64), 1, "single device")
        return Solution(p, "trivial", 0.0, 0.0)
    exact_ok = N == E or num_labelled_partitions(E, N) <= EXACT_DP_LIMIT
    if method == "exact" and not exact_ok:
        raise ValueError(f"no exact solver for E={E}, N={N} ({num_labelled_partitions(E, N)} partitions per layer)")
    if method != "heuristic" and exact_ok:
        p = _exact_matching(A, N) if N == E else _exact_dp(A, N)
        how = "exact (per-boundary assignment)" if N == E else "exact (DP over balanced partitions)"
    else:
        p = _greedy(A, N)
        how = "heuristic (balanced assignment + swaps)"
    return Solution(p, how, volume(A, p), lb)
