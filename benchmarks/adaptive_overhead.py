"""What `adaptive`'s own Python costs a step, outside the engine: its ``begin_step``, its
``propose`` for every request and its ``accepted`` for every request, wrapped around a stub
proposer that drafts at once (so what is timed is the wrapper, not a proposer).

    .venv/bin/python benchmarks/adaptive_overhead.py [--batch 8] [--steps 5000] [--repeat 3]
        [--step-ms 0.2]

Every request's text follows one pattern, and the stub drafts it right but for the last draft:
a chain of 4 yields 4 tokens, as on code completion at batch 8 late in a wave. Each step adds
the tokens the target would have produced (1 without drafts, accepted + 1 with), so the shadow
steps are scored as in the engine, and the controller settles on chains. A step lasts
``--step-ms`` (spun), so it measures step times of that size.

Printed: the median over ``--repeat`` runs of the microseconds per step in each of the three
calls, and the steps each mode was chosen in the last run. ``propose`` is the wrapper's part:
the stub's own time, timed apart on the same calls, is taken out. In the engine the same Python
costs several times more (its working set evicts the plugin's between steps:
``Adaptive.begin_step`` read 30 us in `phase_time.py` at batch 8 against 5 us here), so this
compares versions of the wrapper; it is not a share of a step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Sequence

from vllm_graft.hooks import Proposer


def pattern(position: int) -> int:
    """The token every request's text has at ``position``."""
    return 1 + position % 50


class InstantDrafts(Proposer):
    """Drafts the pattern's next tokens at once, the last one wrong (0)."""

    def __init__(self) -> None:  # no params: nothing to configure
        pass

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        n = len(token_ids)
        return [pattern(n + j) for j in range(max_tokens - 1)] + [0] if max_tokens > 0 else []


def run(batch: int, steps: int, step_ms: float) -> dict[str, Any]:
    """One run of ``steps`` steps; microseconds per step in each call, and the modes chosen."""
    from vllm_graft.plugins.speculative.adaptive import AdaptiveParams
    from vllm_graft.plugins.speculative.adaptive.reference import Adaptive

    stub = InstantDrafts()
    a = Adaptive(AdaptiveParams(proposer="lookahead", num_speculative_tokens=4), inner=stub)
    texts = {f"r{i}": [pattern(j) for j in range(100)] for i in range(batch)}
    drafted = 0
    spent = {"begin_step": 0.0, "propose": 0.0, "accepted": 0.0, "stub": 0.0}
    for _ in range(steps):
        t0 = time.perf_counter()
        on = a.begin_step(batch, batch + drafted)
        t1 = time.perf_counter()
        drafts = [a.propose(r, ids, 4) for r, ids in texts.items()] if on else [[] for _ in texts]
        t2 = time.perf_counter()
        kept = []  # what the target accepted of each request's drafts (not timed)
        for ids, d in zip(texts.values(), drafts):
            n = 0
            while n < len(d) and d[n] == pattern(len(ids) + n):
                n += 1
            kept.append(n)
        t3 = time.perf_counter()
        for r, d, n in zip(texts, drafts, kept):
            if d:
                a.accepted(r, n, len(d))
        t4 = time.perf_counter()
        if on:  # the stub's own share of the propose calls, to take out of them
            for r, ids in texts.items():
                stub.propose(r, ids, 4)
        t5 = time.perf_counter()
        for ids, n in zip(texts.values(), kept):  # the tokens the step produced (not timed)
            ids.extend(pattern(len(ids) + j) for j in range(n + 1))
        drafted = sum(len(d) for d in drafts)
        spent["begin_step"] += t1 - t0
        spent["propose"] += t2 - t1
        spent["accepted"] += t4 - t3
        spent["stub"] += t5 - t4
        while time.perf_counter() - t0 < step_ms / 1e3:
            pass
    assert a.bandit is not None
    spent["propose"] -= spent.pop("stub")  # the wrapper's part of the propose calls
    return {"us_per_step": {k: v / steps * 1e6 for k, v in spent.items()}, "chosen": dict(a.bandit.chosen)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=0.2)
    args = ap.parse_args(argv)
    runs = [run(args.batch, args.steps, args.step_ms) for _ in range(max(1, args.repeat))]
    med = {k: statistics.median(r["us_per_step"][k] for r in runs) for k in runs[0]["us_per_step"]}
    print(
        f"batch {args.batch}, {args.steps} steps x {len(runs)} runs: "
        + ", ".join(f"{k} {v:.2f}" for k, v in med.items())
        + f" us per step (total {sum(med.values()):.2f}); chosen in the last run {runs[-1]['chosen']}"
    )


if __name__ == "__main__":
    main()
