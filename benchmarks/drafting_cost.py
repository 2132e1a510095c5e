"""What a graft proposer costs per engine step on the CPU, through the speculative adapter's own
per-step logic (``Drafting.propose``: each row's tokens copied out of a numpy token matrix, the
acceptance reports, the plugin's ``propose`` calls and the checks of what it returns), without an
engine.

    .venv/bin/python benchmarks/drafting_cost.py DEPLOYMENT [--workload code-completion] [--batch 32]

The texts are ``draft_replay.py``'s greedy outputs (the first ``--batch`` of its 64-prompt cache,
made on first use by plain vLLM). All ``--batch`` requests run in lock step, as a batch of that
size does, each row advancing by what the target would accept of its drafts, until every row has
59 output tokens. Printed: the steps and the mean milliseconds per step of
``Drafting.propose`` (a ``noop`` deployment gives the adapter's own share). ``--idle``: the
deployment's proposer replaced by one that drafts nothing and says so in ``begin_step`` (as
``adaptive`` does on a step it runs without drafts): what the adapter costs on such a step.
``--begin-step``: instead, the microseconds of the deployment's own ``begin_step`` at
``--batch`` requests, called 3,000 times 0.5 ms apart with no drafts reported (``adaptive``
included: what its controller costs on a step it then runs without drafts).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_replay import GraftArm, cache_path, greedy_texts, speculative_plugin  # noqa: E402


def drafting_cost(impl, texts: list[dict], k: int) -> tuple[int, float, dict]:
    """Steps run and seconds of ``Drafting.propose`` per step for ``impl`` over ``texts`` (one
    batch row each, in lock step), with the adapter's event counts."""
    from vllm_graft.integration.adapters.speculative.drafting import Drafting

    counts: dict[str, int] = {}
    drafting = Drafting(impl, "measured", k=k, max_model_len=2048, vocab_size=1 << 30,
                        count=lambda e, n: counts.__setitem__(e, counts.get(e, 0) + n))
    rows = len(texts)
    tokens = np.zeros((rows, 2048), dtype=np.int64)
    pos = [1] * rows
    for i, t in enumerate(texts):
        tokens[i, : len(t["prompt"]) + 1] = t["prompt"] + t["output"][:1]
    req_ids = [str(i) for i in range(rows)]
    sampled = [[t["output"][0]] for t in texts]
    verified: dict[str, list[int]] = {}
    spent, steps = 0.0, 0
    limit = min(len(t["output"]) for t in texts) - 1
    while min(pos) < limit:
        drafting.step_started([], verified, 0)
        num_tokens = [len(texts[i]["prompt"]) + pos[i] for i in range(rows)]
        t0 = time.perf_counter()
        drafts = drafting.propose(req_ids, sampled, num_tokens, tokens)
        spent += time.perf_counter() - t0
        steps += 1
        verified = {}
        for i, d in enumerate(drafts):
            out, p = texts[i]["output"], pos[i]
            n = 0
            while n < len(d) and p + n < len(out) and d[n] == out[p + n]:
                n += 1
            new = out[p : p + n + 1] or [0]  # past its end a row repeats a filler token
            base = len(texts[i]["prompt"]) + p
            tokens[i, base : base + len(new)] = new
            sampled[i], pos[i] = new, p + len(new)
            if d:
                verified[req_ids[i]] = d
    return steps, spent / max(1, steps), counts


class Idle:
    """A proposer that drafts nothing and says so before the step (``begin_step`` False)."""

    def begin_step(self, num_requests: int, num_tokens: int = 0) -> bool:
        return False

    def accepted(self, request_id: str, num_accepted: int, num_verified: int) -> None:
        pass

    def finish(self, request_id: str) -> None:
        pass


def begin_step_cost(path: str, batch: int, calls: int = 3000) -> tuple[float, Any]:
    """Median seconds of the deployment's proposer's ``begin_step(batch, batch)``, called
    ``calls`` times 0.5 ms apart, and the proposer (for its ``describe()``)."""
    _, impl = speculative_plugin(path, "time")
    spent = []
    for _ in range(calls):
        t = time.perf_counter()
        impl.begin_step(batch, batch)
        spent.append(time.perf_counter() - t)
        time.sleep(0.0005)
    return statistics.median(spent), impl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("deployment")
    ap.add_argument("--workload", default="code-completion")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--idle", action="store_true", help="a proposer that drafts nothing, said in begin_step")
    ap.add_argument("--begin-step", action="store_true", help="time the deployment's begin_step alone")
    a = ap.parse_args()
    if a.begin_step:
        seconds, impl = begin_step_cost(a.deployment, a.batch)
        print(f"{a.deployment}: begin_step at batch {a.batch}, median {seconds * 1e6:.1f} microseconds")
        return
    settings = {"workload": a.workload, "num_prompts": 64, "max_tokens": 64, "batch": 32}
    texts = greedy_texts(settings, cache_path(a.workload, 64, 64))[: a.batch]
    arm = GraftArm(a.deployment)
    steps, per_step, counts = drafting_cost(Idle() if a.idle else arm.impl, texts, arm.k)
    print(f"{a.deployment}{' (--idle)' if a.idle else ''} {a.workload}: {steps} steps at batch {len(texts)}, Drafting.propose "
          f"{per_step * 1e3:.3f} ms per step; {counts}")


if __name__ == "__main__":
    main()
