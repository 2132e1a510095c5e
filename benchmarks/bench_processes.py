"""One ``vllm-graft bench`` comparison run ``N`` times, each time in fresh engine processes: the
spread between invocations, which one invocation's paired range does not show.

    .venv/bin/python benchmarks/bench_processes.py N [--apart] BENCH-ARGUMENTS...

e.g. ``benchmarks/bench_processes.py 5 deployments/spec-tree-lookahead.yaml --baseline
deployments/spec-lookahead.yaml --baseline-as-is --workload code-completion --batch 1
--num-prompts 8 --max-tokens 64 --repeat 3 --seed 0 --no-ppl``.

Each invocation of the bench starts one process per arm and runs every repeat of that arm in it,
so its runs share that process's state (where its memory landed, which kernels its libraries
chose). On this 2-core machine one engine process differs from the next by more than the 3% a
target such as "never below 0.97x plain" needs: the same tree-against-chain comparison, with the
same drafts every time, read from 0.63 to 1.28 in five invocations of this script
(docs/benchmarks/speculative.md). So a claim of that size needs several invocations: this runs them one after another (nothing else should
run beside it) and prints each invocation's ratio, its paired range and whether the greedy
outputs were identical, then the median of the invocations' ratios with their min-max, and the
median of all their paired per-run ratios.

With ``--apart`` (given before the bench's arguments) no process holds both engines: each
invocation runs the bench twice, ``--arms graft`` and then ``--arms plain`` (the order swapped
every other invocation), so one engine is loaded at a time; the ratio is the graft arm's tokens/s
over the plain arm's, the paired runs are run r against run r, and the greedy outputs are compared
request by request across the two documents. This tells whether a difference comes from the
deployment or from two engines resident side by side.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

VLLM_GRAFT = Path(sys.executable).with_name("vllm-graft")


def invocation(i: int, result: dict[str, Any]) -> tuple[str, float | None, list[float]]:
    """Invocation ``i``'s line, its graft/plain ratio (None without one) and its paired runs'
    ratios, from its bench result (the ``--json`` document)."""
    comparison = result.get("comparison") or {}
    speed = comparison.get("ratio") or {}
    if speed.get("ratio") is None:
        return f"invocation {i}: no graft/plain ratio (an arm missing or failed)", None, []
    paired = f"{speed['min']:.3f}-{speed['max']:.3f}" if speed.get("min") is not None else "-"
    line = (
        f"invocation {i}: {speed['ratio']:.3f} (paired {paired}); greedy outputs identical: "
        f"{comparison.get('n_identical', '?')}/{comparison.get('n', '?')}"
    )
    if comparison.get("tok_s"):
        line += "; graft {:.0f}, plain {:.0f} tok/s".format(*comparison["tok_s"])
    return line, speed["ratio"], [r for r in speed.get("runs") or [] if r is not None]


def summarise(results: list[dict[str, Any]]) -> list[str]:
    """The report's lines for the invocations' bench results: one per invocation, then the
    median of their ratios with its min-max and the median of all their paired runs."""
    lines, ratios, pooled = [], [], []
    for i, result in enumerate(results, 1):
        line, ratio, runs = invocation(i, result)
        lines.append(line)
        if ratio is not None:
            ratios.append(ratio)
            pooled += runs
    if ratios:
        lines.append(
            f"over {len(ratios)} invocations: median ratio {statistics.median(ratios):.3f} "
            f"(min-max {min(ratios):.3f}-{max(ratios):.3f})"
            + (f"; median of all {len(pooled)} paired runs {statistics.median(pooled):.3f}" if pooled else "")
        )
    return lines


def _requests(doc: dict[str, Any], arm: str) -> dict[tuple[str, int], list[int]]:
    arm_doc = (doc.get("arms") or {}).get(arm) or {}
    return {
        (name, r["index"]): r.get("output_token_ids")
        for name, w in (arm_doc.get("workloads") or {}).items()
        for r in w.get("requests") or []
    }


def apart(graft_doc: dict[str, Any], plain_doc: dict[str, Any]) -> dict[str, Any]:
    """A bench result's ``comparison`` (the shape ``invocation`` reads) from two single-arm
    documents: the graft arm's tokens/s over the plain arm's, run r against run r, and how many
    requests gave the same greedy tokens in both."""
    overall = [((d.get("arms") or {}).get(a) or {}).get("overall") or {} for d, a in ((graft_doc, "graft"), (plain_doc, "plain"))]
    g, p = (o.get("output_tok_s") for o in overall)
    if not g or not p:
        return {"comparison": None}
    runs = [gr / pr for gr, pr in zip(overall[0].get("output_tok_s_runs") or [], overall[1].get("output_tok_s_runs") or []) if pr]
    graft_out, plain_out = _requests(graft_doc, "graft"), _requests(plain_doc, "plain")
    same = sum(1 for key, ids in graft_out.items() if key in plain_out and plain_out[key] == ids)
    return {"comparison": {
        "ratio": {"ratio": g / p, "min": min(runs, default=None), "max": max(runs, default=None), "runs": runs},
        "n_identical": same, "n": len(graft_out), "tok_s": (g, p),
    }}


def _bench(bench: list[str], path: Path) -> dict[str, Any] | int:
    done = subprocess.run([str(VLLM_GRAFT), "bench", *bench, "--json", str(path)], stdout=subprocess.DEVNULL)
    if done.returncode != 0 or not path.exists():
        return done.returncode or 1
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or not args[0].isdigit() or int(args[0]) < 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        print("error: give the number of invocations (at least 1), then the bench's arguments", file=sys.stderr)
        return 2
    if "--json" in args[1:] or "--suite" in args[1:]:
        print("error: this script writes --json itself, and runs one comparison (not --suite)", file=sys.stderr)
        return 2
    n, bench = int(args[0]), args[1:]
    separate = bench[0] == "--apart"
    if separate:
        bench = bench[1:]
        if any(a == "--arms" or a.startswith("--arms=") for a in bench):
            print("error: --apart runs each arm alone itself; leave out --arms", file=sys.stderr)
            return 2
        if not bench:
            print("error: give the bench's arguments after --apart", file=sys.stderr)
            return 2
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(n):
            # (label, arguments) of each bench this invocation runs: one, or one per arm
            arms = ("graft", "plain") if i % 2 == 0 else ("plain", "graft")
            runs = [(arm, [*bench, "--arms", arm]) for arm in arms] if separate else [("", bench)]
            docs = {}
            for arm, arguments in runs:
                doc = _bench(arguments, Path(tmp) / f"{i}-{arm or 'both'}.json")
                if isinstance(doc, int):
                    who = f"the bench's {arm} arm" if arm else "the bench"
                    print(f"invocation {i + 1}: {who} exited {doc}; stopping", file=sys.stderr)
                    return doc
                docs[arm] = doc
            results.append(apart(docs["graft"], docs["plain"]) if separate else docs[""])
            print(invocation(i + 1, results[-1])[0], flush=True)
    print(summarise(results)[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
