"""What `adaptive` chose, step by step: the shape of each step (tree, chain, off, shadow) over the
bench's timed runs, and the steps it timed for each shape.

    .venv/bin/python benchmarks/adaptive_modes.py DEPLOYMENT [--workload code-completion]
        [--num-prompts 8] [--max-tokens 64] [--batch 1] [--repeat 3]

One in-process engine in a fresh child process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with
``max_num_seqs = --batch``; a short warm-up, then ``--repeat`` runs of the workload (greedy, not
``ignore_eos``), the drafting state renewed before each as the bench does. The deployment's
speculative plugin must be ``adaptive`` with ``measure_goodput`` on. Printed:

* one character per step's choice (``T`` tree, ``.`` chain, ``o`` off, ``s`` shadow; ``|`` starts
  a run), and how many steps chose each;
* per shape, the steps recorded for it (decode-only, :meth:`ModeChooser.record`): how many, their
  median time, the tokens per request they yielded, and how many were timed (``steady``);
* the plugin's own report (its events: ``trees`` is how many trees with branches were verified).
"""

from __future__ import annotations

import collections
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _profiling import child_engine_setup, fresh_run, run_in_child, workload_parser, workload_settings  # noqa: E402

CODES = {"tree": "T", "chain": ".", "off": "o", "shadow": "s", "run": "|"}


def summarize(choices: list[str], records: list[tuple[str, int, float, int, bool]]) -> list[str]:
    """``choices``: each step's chosen mode (``"run"`` marks a run's start); ``records``: each
    recorded step as ``(mode, batch size, seconds, tokens, timed)``."""
    counts = collections.Counter(c for c in choices if c != "run")
    lines = [
        "chosen: " + ", ".join(f"{m} {counts[m]}" for m in ("tree", "chain", "off", "shadow") if counts[m]),
        "".join(CODES.get(c, "?") for c in choices),
    ]
    for mode in ("tree", "chain", "off"):
        rs = [r for r in records if r[0] == mode]
        if rs:
            lines.append(
                f"recorded {mode}: {len(rs)} steps, median {1e3 * statistics.median(r[2] for r in rs):.3f} ms, "
                f"{statistics.mean(r[3] / max(1, r[1]) for r in rs):.2f} tokens per request, "
                f"{sum(r[4] for r in rs)} timed"
            )
    return lines


def _child(path: str, settings: dict, out) -> None:
    launch, plan, ps = child_engine_setup(path, settings["workload"], settings["num_prompts"], settings["max_tokens"])
    from vllm import SamplingParams

    from vllm_graft.integration.runtime import RUNTIME
    from vllm_graft.plugins.speculative.adaptive import policy

    choices: list[str] = []
    steps: list[tuple] = []  # (mode, batch size, the expected chain yield it was given)
    records: list[tuple] = []
    choose, record = policy.ModeChooser.choose, policy.ModeChooser.record

    def choose_logged(self, batch_size, expected, *args, **kwargs):
        mode = choose(self, batch_size, expected, *args, **kwargs)
        choices.append(mode)
        steps.append((mode, int(batch_size), round(float(expected), 2)))
        return mode

    def record_logged(self, batch_size, mode, seconds, tokens=0):
        records.append((mode, int(batch_size), float(seconds), int(tokens), self.timed(mode)))
        return record(self, batch_size, mode, seconds, tokens)

    policy.ModeChooser.choose, policy.ModeChooser.record = choose_logged, record_logged
    prompts = [{"prompt_token_ids": list(p.token_ids)} for p in ps.prompts]
    with launch.in_process_engine(plan, graft=True, max_num_seqs=settings["batch"]) as llm:
        llm.generate(prompts[: settings["batch"]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        choices.clear()
        steps.clear()
        records.clear()
        for _ in range(settings["repeat"]):
            fresh_run(llm)
            choices.append("run")
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=settings["max_tokens"]), use_tqdm=False)
        report = [r for r in RUNTIME.report() if r.get("name") == "adaptive"]
    out.send({"choices": choices, "steps": steps, "records": records, "report": report})


def main(argv: list[str] | None = None) -> None:
    ap = workload_parser(__doc__.split("\n")[0], workload="code-completion", num_prompts=8, batch=1)
    ap.add_argument("--trace", action="store_true", help="also print each step's mode, batch size and expected chain yield")
    args = ap.parse_args(argv)
    settings = workload_settings(args)
    got = run_in_child(_child, args.deployment, settings, what="the adaptive engine")
    if not got["report"]:
        sys.exit(f"{args.deployment}: no `adaptive` speculative plugin ran (its report is empty)")
    for line in summarize(got["choices"], got["records"]):
        print(line)
    if args.trace:
        for mode, batch, expected in got["steps"]:
            print(f"  {mode:6s} B={batch:3d} expected={expected}")
    r = got["report"][0]
    print("events:", r.get("events"))
    described = r.get("described") or {}
    print("described:", {k: described.get(k) for k in ("step_ms", "steps_by_mode", "tree_gain", "chosen_lengths")})


if __name__ == "__main__":
    main()
