"""The load of a serving sweep: the phases (open-loop request rates, closed-loop concurrency
levels), the seeded Poisson arrival times and the requests. Pure: no vLLM, no network.

Every arm gets the same requests at the same times: the workload's prompts are built once
from the seed and dealt out (:func:`deal`): the first to the warm-up, the next to the
calibration, then ``n`` to each phase in turn, so no prompt is sent twice to a server (a
proposer that drafts from earlier outputs, such as lookahead's n-gram pool, would otherwise
draft a repeat from its first answer), and the arrival times of a rate are a function of the
seed and the rate alone (:func:`poisson_arrivals`). Each phase also sends its requests with a
prefix-cache salt of its own (:meth:`Phase.cache_salt`), so no phase reads KV that an
earlier one computed (the bench resets the prefix cache before each run for the same reason).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal, Sequence


@dataclass(frozen=True)
class Phase:
    """One load level of the sweep: ``rate`` (open loop: Poisson arrivals at ``value``
    requests/s) or ``concurrency`` (closed loop: ``value`` requests in flight, the next sent
    as one ends)."""

    mode: Literal["rate", "concurrency"]
    value: float
    round: int = 1  # the sweep's pass over its loads (``--rounds``): each with prompts of its own

    @property
    def load(self) -> str:
        """The load alone, the same in every round."""
        if self.mode == "rate":
            return f"{self.value:g} req/s"
        return f"concurrency {int(self.value)}"

    @property
    def label(self) -> str:
        return self.load + (f", round {self.round}" if self.round > 1 else "")

    @property
    def key(self) -> str:
        """A short stable name (JSON keys, the prefix-cache salt)."""
        base = f"rate={self.value:g}" if self.mode == "rate" else f"concurrency={int(self.value)}"
        return base + (f".round{self.round}" if self.round > 1 else "")

    def cache_salt(self, seed: int) -> str:
        return f"vllm-graft.servebench.{seed}.{self.key}"

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "value": self.value, "label": self.label, "load": self.load, "round": self.round}


def parse_list(text: str, *, integer: bool = False, what: str = "value") -> list[float]:
    """``"0.25,0.5,1"`` -> ``[0.25, 0.5, 1.0]``; positive numbers only (integers with ``integer``),
    in the order given, no repeats."""
    out: list[float] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = float(int(part)) if integer else float(part)
        except ValueError:
            raise ValueError(
                f"{what} {part!r}: give {'whole ' if integer else ''}numbers separated by commas"
            ) from None
        if not value > 0 or value != value or value == float("inf"):
            raise ValueError(f"{what} {part!r}: must be a positive number")
        if value in out:
            raise ValueError(f"{what} {part!r} is given twice")
        out.append(value)
    if not out:
        raise ValueError(f"no {what} given")
    return out


def phases(rates: Sequence[float] = (), concurrency: Sequence[float] = (), rounds: int = 1) -> list[Phase]:
    """The sweep's phases: the rates in the order given, then the concurrency levels; ``rounds``
    times over (round 1's loads, then round 2's, ...), so that a slow drift of the machine
    touches every load of an arm alike, and a load's later rounds run on a server that has
    run it before."""
    if rounds < 1:
        raise ValueError(f"--rounds {rounds}: give at least 1")
    return [
        ph
        for k in range(1, rounds + 1)
        for ph in [Phase("rate", float(r), k) for r in rates]
        + [Phase("concurrency", float(int(c)), k) for c in concurrency]
    ]


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Send times (seconds from the phase's start) of ``n`` requests of a Poisson process at
    ``rate`` requests/s: the first at 0, then exponential gaps of mean ``1 / rate``. A function
    of (seed, rate, n) only, so every arm of a sweep gets the same times (the generator is
    seeded with a string: stable across runs, machines and Python versions)."""
    if rate <= 0:
        raise ValueError(f"rate {rate}: must be positive")
    rng = random.Random(f"vllm-graft-servebench:{seed}:{rate!r}")
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


@dataclass(frozen=True)
class ServeRequest:
    """One request of a phase: the prompt as token ids (exact lengths, as the bench sends
    them), its output budget; greedy always (temperature 0), so lossless arms must match."""

    index: int
    prompt: tuple[int, ...]
    max_tokens: int

    def body(self, model: str, *, ignore_eos: bool, cache_salt: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "prompt": list(self.prompt),
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": ignore_eos,
        }
        if cache_salt:
            body["cache_salt"] = cache_salt
        return body


def requests_from_prompts(prompts: Sequence[Any]) -> list[ServeRequest]:
    """The requests of every phase from a workload's prompts (:class:`~vllm_graft.tools.workloads.Prompt`:
    ``token_ids`` and ``max_tokens``, which the workload already fitted to ``max_model_len``)."""
    return [ServeRequest(i, tuple(p.token_ids), int(p.max_tokens)) for i, p in enumerate(prompts)]


@dataclass(frozen=True)
class Dealt:
    """The workload's requests dealt out: the warm-up's, the calibration's, each phase's (by
    :attr:`Phase.key`, indexed from 0 within the phase)."""

    warm_up: list[ServeRequest]
    calibration: list[ServeRequest]
    phases: dict[str, list[ServeRequest]]


def prompts_needed(n: int, num_phases: int, warm_up: int, calibration: int, warm_up_extra: int = 0) -> int:
    return warm_up + calibration + n * num_phases + warm_up_extra


def deal(
    requests: Sequence[ServeRequest],
    phases: Sequence[Phase],
    n: int,
    *,
    warm_up: int,
    calibration: int,
    warm_up_tokens: int,
    warm_up_extra: int = 0,
) -> Dealt:
    """Deal ``requests`` (:func:`prompts_needed` of them, in the workload's order) out: the
    first ``warm_up`` (their output cut to ``warm_up_tokens``), the next ``calibration``, then
    ``n`` per phase in the order of ``phases``, then ``warm_up_extra`` more for the warm-up (so
    that a larger warm-up leaves the calibration's and the phases' requests as they were). No
    request goes to two places."""
    need = prompts_needed(n, len(phases), warm_up, calibration, warm_up_extra)
    if len(requests) < need:
        raise ValueError(f"{len(requests)} prompts for {need} requests")
    extra = list(requests[need - warm_up_extra : need])
    warm = [
        ServeRequest(i, r.prompt, min(r.max_tokens, warm_up_tokens))
        for i, r in enumerate(list(requests[:warm_up]) + extra)
    ]
    calib = [ServeRequest(i, r.prompt, r.max_tokens) for i, r in enumerate(requests[warm_up : warm_up + calibration])]
    out: dict[str, list[ServeRequest]] = {}
    start = warm_up + calibration
    for ph in phases:
        chunk = requests[start : start + n]
        out[ph.key] = [ServeRequest(i, r.prompt, r.max_tokens) for i, r in enumerate(chunk)]
        start += n
    return Dealt(warm, calib, out)
