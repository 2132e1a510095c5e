"""Where the time of a deployment's generation goes, plugin arm against plain vLLM: the profile
behind a bench row that misses its target.

    .venv/bin/python benchmarks/profile_steps.py DEPLOYMENT [--workload chat] [--num-prompts 4]
        [--max-tokens 32] [--top 12] [--out FILE.md]

For each arm (the deployment, then its plain twin, as `vllm-graft bench` builds them) a fresh
child process starts the engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the model
runs in the profiled process), generates the workload once to warm up, then generates it again
under cProfile (greedy, all requests at once, ``ignore_eos``). The report gives, per arm: the
profiled run's wall time (cProfile slows Python-heavy code more than kernels, so compare the
arms' shares rather than the absolute times), the time inside vllm-graft's own functions
(outermost calls into ``hooks``, ``integration`` and ``plugins``), and the functions with the
most time of their own (``tottime``: torch ops show as ``built-in method ...``), each with its
calls. Perplexity and output equality are the bench's business, not this script's.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _profiling import child_engine_setup, fresh_run, label, outermost_ours, run_in_child  # noqa: E402


def _child(path: str, graft: bool, settings: dict, out) -> None:
    import cProfile
    import pstats
    import time

    launch, plan, ps = child_engine_setup(path, settings["workload"], settings["num_prompts"], settings["max_tokens"])
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": list(p.token_ids)} for p in ps.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=settings["max_tokens"], ignore_eos=True)
    with launch.in_process_engine(plan, graft=graft) as llm:
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: every shape seen once
        fresh_run(llm)  # no drafts from the earlier runs' outputs
        profile = cProfile.Profile()
        t = time.perf_counter()
        profile.enable()
        outs = llm.generate(prompts, params, use_tqdm=False)
        profile.disable()
        wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = pstats.Stats(profile).stats  # {(file, line, fn): (cc, nc, tt, ct, callers)}
    top = outermost_ours(stats)
    own = sorted(((v[2], v[1], label(k)) for k, v in stats.items()), reverse=True)[: settings["top"]]
    ours_top = sorted(((v[3], v[1], label(k)) for k, v in top.items()), reverse=True)[: settings["top"]]
    out.send({"wall_s": wall, "tokens": tokens, "ours_s": sum(v[3] for v in top.values()),
              "own": own, "ours_top": ours_top})


def _run(path: str, graft: bool, settings: dict) -> dict:
    return run_in_child(_child, path, graft, settings, what=f"{path}: the {'plugin' if graft else 'plain'} engine")


def render(path: str, settings: dict, arms: dict[str, dict]) -> str:
    lines = [f"# Profile of `{path}`", "",
             f"`benchmarks/profile_steps.py {path} --workload {settings['workload']} --num-prompts "
             f"{settings['num_prompts']} --max-tokens {settings['max_tokens']}`: one warmed-up generation "
             "per arm under cProfile (in-process engine, greedy, all requests at once).", "",
             "| arm | profiled wall s | output tokens | tok/s under the profiler | in vllm-graft's code |",
             "|---|---:|---:|---:|---:|"]
    for arm, r in arms.items():
        share = f"{r['ours_s']:.3f} s ({r['ours_s'] / r['wall_s'] * 100:.0f}%)" if r["wall_s"] else "-"
        lines.append(f"| {arm} | {r['wall_s']:.2f} | {r['tokens']} | {r['tokens'] / r['wall_s']:.1f} | {share} |")
    for arm, r in arms.items():
        lines += ["", f"## {arm}: most time of their own", "", "| s | calls | function |", "|---:|---:|---|"]
        lines += [f"| {t:.3f} | {n} | `{name}` |" for t, n, name in r["own"]]
        if r["ours_top"]:
            lines += ["", f"## {arm}: vllm-graft's outermost calls (cumulative)", "",
                      "| s | calls | function |", "|---:|---:|---|"]
            lines += [f"| {t:.3f} | {n} | `{name}` |" for t, n, name in r["ours_top"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("deployment")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--top", type=int, default=12, help="functions listed per table (default 12)")
    ap.add_argument("--out", help="write the report (Markdown) here too")
    args = ap.parse_args()
    settings = {"workload": args.workload, "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
                "top": args.top}
    arms = {"plugin": _run(args.deployment, True, settings), "plain": _run(args.deployment, False, settings)}
    text = render(args.deployment, settings, arms)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
