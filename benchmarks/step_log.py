"""Each engine step of a deployment's generation, plugin arm and plain arm: how long it took, how
many requests and tokens it computed and how many tokens it produced, summed per batch-size
bucket over the decode-only steps. The measurement behind a speculative row that a ratio alone
does not explain (is a drafting step paying for its extra tokens at this batch size?).

    .venv/bin/python benchmarks/step_log.py DEPLOYMENT [--workload extractive] [--num-prompts 64]
        [--max-tokens 64] [--batch 32] [--repeat 3] [--every-step]

For each arm (the deployment, then its plain twin) a fresh child process starts the engine
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with ``max_num_seqs = --batch``, generates the
workload once to warm up and then ``--repeat`` times (greedy, end of sequence honoured, as the
suite's rows run), wrapping vLLM's ``GPUModelRunner.execute_model`` and ``sample_tokens`` to
stamp each step. A step's interval runs from the previous step's sampling to its own, so it
holds the scheduler, the drafting and the output processing as well as the forward pass.
Decode-only steps (no prompt chunk scheduled) are grouped by batch-size bucket (``B < 2^n``);
the last timed run is reported. Printed, not written: nothing here is a suite figure.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _profiling import child_engine_setup, fresh_run, run_in_child, workload_parser, workload_settings  # noqa: E402


def _child(path: str, graft: bool, settings: dict, out) -> None:
    launch, plan, ps = child_engine_setup(path, settings["workload"], settings["num_prompts"], settings["max_tokens"])
    from vllm import SamplingParams
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    log: list[tuple] = []
    state: dict = {}
    execute, sample = GPUModelRunner.execute_model, GPUModelRunner.sample_tokens

    def execute_model(self, scheduler_output, *args, **kwargs):
        spec = scheduler_output.scheduled_spec_decode_tokens
        state["decode"] = not scheduler_output.scheduled_new_reqs and all(
            n <= 1 + len(spec.get(r, ())) for r, n in scheduler_output.num_scheduled_tokens.items()
        )
        state["requests"] = len(scheduler_output.num_scheduled_tokens)
        state["tokens"] = scheduler_output.total_num_scheduled_tokens
        return execute(self, scheduler_output, *args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        output = sample(self, *args, **kwargs)
        produced = sum(len(t) for t in getattr(output, "sampled_token_ids", None) or ())
        log.append((time.perf_counter(), state.get("requests", 0), state.get("tokens", 0), produced,
                    state.get("decode", False)))
        return output

    GPUModelRunner.execute_model, GPUModelRunner.sample_tokens = execute_model, sample_tokens
    prompts = [{"prompt_token_ids": list(p.token_ids)} for p in ps.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=settings["max_tokens"])
    runs = []
    with launch.in_process_engine(plan, graft=graft, max_num_seqs=settings["batch"]) as llm:
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        for _ in range(settings["repeat"]):
            fresh_run(llm)  # no drafts from the earlier runs' outputs
            log.clear()
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t
            runs.append({"wall_s": wall, "tokens": sum(len(o.outputs[0].token_ids) for o in outs), "log": list(log)})
    out.send(runs)


def summarize(runs: list[dict], every_step: bool = False) -> list[str]:
    last = runs[-1]
    steps = [(cur[0] - prev[0], *cur[1:]) for prev, cur in zip(last["log"], last["log"][1:])]
    decode = [s for s in steps if s[4]]
    lines = [
        f"tok/s per run {[round(r['tokens'] / r['wall_s']) for r in runs]}; last run: {len(last['log'])} steps, "
        f"{len(decode)} decode-only taking {sum(s[0] for s in decode):.3f} s, the others "
        f"{sum(s[0] for s in steps if not s[4]):.3f} s, wall {last['wall_s']:.3f} s"
    ]
    buckets: dict[int, list[tuple]] = {}
    for s in decode:
        buckets.setdefault(max(1, s[1]).bit_length(), []).append(s)
    for b, ss in sorted(buckets.items()):
        secs = statistics.median(s[0] for s in ss)
        produced = statistics.mean(s[3] for s in ss)
        lines.append(
            f"  B<{2 ** b}: {len(ss)} steps, median {secs * 1e3:.2f} ms, mean requests {statistics.mean(s[1] for s in ss):.1f}, "
            f"tokens computed {statistics.mean(s[2] for s in ss):.1f}, produced {produced:.1f} "
            f"({produced / (secs * 1e3):.2f} per ms at the median)"
        )
    if every_step:  # the last run's steps in order: ms, requests, tokens computed, produced, decode-only
        lines += [f"    {s[0] * 1e3:7.2f} ms {s[1]:3d} requests {s[2]:5d} computed {s[3]:4d} produced"
                  f"{'' if s[4] else '  (prompt chunks)'}" for s in steps]
    return lines


def main() -> None:
    ap = workload_parser(__doc__.split("\n\n")[0], workload="extractive", num_prompts=64, batch=32)
    ap.add_argument("--every-step", action="store_true", help="also list the last run's steps in order")
    a = ap.parse_args()
    settings = workload_settings(a)
    for graft in (True, False):
        arm = "plugin" if graft else "plain"
        runs = run_in_child(_child, a.deployment, graft, settings, what=f"{a.deployment}: the {arm} engine")
        print(f"{arm}: " + "\n".join(summarize(runs, a.every_step)), flush=True)


if __name__ == "__main__":
    main()
