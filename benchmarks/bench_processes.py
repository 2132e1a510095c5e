"""One ``vllm-graft bench`` comparison run ``N`` times, each time in fresh engine processes: the
spread between invocations, which one invocation's paired range does not show.

    .venv/bin/python benchmarks/bench_processes.py N BENCH-ARGUMENTS...

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
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(n):
            path = Path(tmp) / f"{i}.json"
            done = subprocess.run([str(VLLM_GRAFT), "bench", *bench, "--json", str(path)], stdout=subprocess.DEVNULL)
            if done.returncode != 0 or not path.exists():
                print(f"invocation {i + 1}: the bench exited {done.returncode}; stopping", file=sys.stderr)
                return done.returncode or 1
            results.append(json.loads(path.read_text()))
            print(invocation(i + 1, results[-1])[0], flush=True)
    print(summarise(results)[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
