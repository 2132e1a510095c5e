"""`vllm-graft bench DEPLOYMENT`: the command line and the parent side of a bench run: build
the workloads, run each arm in its own spawned process (:mod:`.arm`), assemble, render and
write the result."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.markup import escape

from .arm import _arm_main
from .report import render_report, write_plot
from .stats import ARMS, assemble

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_RUN_FAILED, EXIT_DIFFERENT = 0, 1, 2, 4, 5


# ===================================================================== the parent side
class ArmFailed(RuntimeError):
    def __init__(self, arm: str, message: str, log_path: str, error_type: str | None = None) -> None:
        super().__init__(message)
        self.arm, self.log_path, self.error_type = arm, log_path, error_type


def _run_child(job: dict[str, Any], workdir: Path, on_event: Callable[[str, str, Any], None],
               timeout: float | None = None) -> dict[str, Any]:
    """Run one arm in a spawned child process; events are passed to ``on_event``."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    result_path = str(workdir / f"{job['arm']}.json")
    proc = ctx.Process(target=_arm_main, args=(job, result_path, sender), name=f"vllm-graft-bench-{job['arm']}")
    proc.start()
    sender.close()  # the child holds the only write end: EOF when it exits
    start = time.monotonic()
    try:
        while True:
            if receiver.poll(0.2):
                try:
                    on_event(*receiver.recv())
                except EOFError:
                    break
            elif not proc.is_alive() and not receiver.poll(0):
                break
            if timeout and time.monotonic() - start > timeout:
                raise ArmFailed(job["arm"], f"timed out after {timeout:.0f} s", job["log_path"])
        proc.join(60)  # the result is on disk once the pipe is closed; a stuck teardown is ended below
    finally:
        receiver.close()
        if proc.is_alive():
            proc.terminate()
            proc.join(10)
    if not os.path.exists(result_path):
        raise ArmFailed(job["arm"], f"the process exited with code {proc.exitcode} and wrote no result",
                        job["log_path"])
    with open(result_path) as f:
        result = json.load(f)
    if "error" in result:
        raise ArmFailed(job["arm"], result["error"], job["log_path"], result.get("error_type"))
    return result


def _parse_arms(text: str) -> list[str]:
    arms = []
    for part in text.split(","):
        part = part.strip()
        if part not in ARMS:
            raise ValueError(f"unknown arm {part!r}; accepted: {', '.join(ARMS)} (comma list)")
        if part not in arms:
            arms.append(part)
    if not arms:
        raise ValueError(f"no arm named; accepted: {', '.join(ARMS)}")
    return arms


def _max_model_len(plan: Any) -> int:
    value = plan.deployment.engine.get("max_model_len")
    if value:
        return int(value)
    if plan.model is not None:
        cfg = json.loads((Path(plan.model.path) / "config.json").read_text())
        for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
            if cfg.get(key):
                return int(cfg[key])
    return 2048


def _tail(path: str, n: int = 25) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def cmd_bench(args: argparse.Namespace, console: Console) -> int:
    from vllm_graft.tools import workloads as W

    out = Console(stderr=True, highlight=False, width=console.width) if args.json == "-" else console
    err = Console(stderr=True, highlight=False, width=console.width)

    if args.list_workloads:
        for w in W.WORKLOADS.values():
            out.print(f"[bold]{w.name}[/]: {escape(w.summary)}\n  {escape(w.describe)}")
        return EXIT_OK
    if not args.deployment:
        err.print("[bold red]error:[/] give a deployment file: vllm-graft bench DEPLOYMENT.yaml")
        return EXIT_USAGE
    try:
        arms = _parse_arms(args.arms)
        names = W.parse_names(args.workload)
    except ValueError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}")
        return EXIT_USAGE
    if args.num_prompts < 1 or args.max_tokens < 1 or args.batch < 0 or args.repeat < 1:
        err.print("[bold red]error:[/] --num-prompts, --max-tokens and --repeat must be at least 1, "
                  "--batch at least 0")
        return EXIT_USAGE

    from vllm_graft.hooks import DeploymentError

    from vllm_graft.integration.launch import llm_kwargs, load_plan

    try:
        plan = load_plan(args.deployment)
    except DeploymentError as e:
        n = len(e.problems)
        err.print(f"[bold red]✗ {escape(e.source)}: {n} problem{'s' if n != 1 else ''}[/] (no engine started)")
        for p in e.problems:
            err.print(f"  [red]•[/] {escape(str(p))}")
        return EXIT_INVALID

    max_model_len = _max_model_len(plan)
    try:
        model = plan.model.path if plan.model is not None else plan.deployment.model
        if model is None:
            raise W.WorkloadError("the deployment names no model (model: FOLDER)")
        try:
            tokenizer = W.Tokenizer.from_model(model)
        except (OSError, ValueError, ImportError) as e:
            err.print(f"[bold red]error:[/] cannot load the tokenizer of {escape(str(model))}: {escape(str(e))}")
            return EXIT_INVALID
        prompt_sets = W.build(names, tokenizer, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                              max_model_len=max_model_len, seed=args.seed)
    except W.WorkloadError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}")
        return EXIT_USAGE

    plugins = [f"{e.kind}:{e.name}" for e in plan.enabled]
    settings = {"arms": arms, "workloads": names, "num_prompts": args.num_prompts,
                "max_tokens": args.max_tokens, "batch": args.batch, "repeat": args.repeat, "seed": args.seed,
                "ignore_eos": args.ignore_eos, "max_model_len": max_model_len,
                "perplexity": not args.no_ppl, "temperature": 0.0}
    wl_jobs = [{"name": ps.name, "prompts": [{"token_ids": list(p.token_ids), "max_tokens": p.max_tokens}
                                             for p in ps.prompts]} for ps in prompt_sets]
    by_name = {ps.name: [list(p.token_ids) for p in ps.prompts] for ps in prompt_sets}
    # Per-request stats on (the cross-check of TTFT/ITL); the seed unless the deployment sets one.
    overrides: dict[str, Any] = {"disable_log_stats": False}
    if "seed" not in plan.deployment.engine:
        overrides["seed"] = args.seed
    keep_logs = args.log_dir is not None
    workdir = Path(args.log_dir) if keep_logs else Path(tempfile.mkdtemp(prefix="vllm-graft-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)

    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn)

    t_start = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    scores: dict[str, list[float]] | None = None
    plan_runs: list[tuple[str, bool, bool]] = []  # (arm, generate, score)
    if "graft" in arms:
        plan_runs.append(("graft", True, False))
    if "plain" in arms:
        plan_runs.append(("plain", True, not args.no_ppl))
    elif not args.no_ppl:
        plan_runs.append(("plain", False, True))  # scorer only: the unmodified model

    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TextColumn("{task.fields[unit]}"), TimeElapsedColumn(),
                        console=out, transient=False)
    totals: dict[Any, int] = {}
    try:
        with progress:
            for arm, generate, score in plan_runs:
                label = arm if generate else "plain (scoring only)"
                task = progress.add_task(f"{label}: starting", total=None, unit="tokens")
                score_task: list[Any] = []

                def on_event(who: str, kind: str, payload: Any, task=task, label=label,
                             score_task=score_task) -> None:
                    if kind == "phase":
                        progress.update(task, description=f"{label}: {payload}")
                        if payload == "done" and task in totals:  # EOS can end requests early
                            progress.update(task, completed=totals[task])
                    elif kind == "total":
                        totals[task] = payload
                        progress.update(task, total=payload)
                    elif kind == "advance":
                        progress.advance(task, payload)
                    elif kind == "total_score":
                        if task in totals:  # generation done (fewer tokens than budgeted at EOS)
                            progress.update(task, completed=totals[task])
                        score_task.append(progress.add_task(f"{label}: perplexity", total=payload, unit="sequences"))
                    elif kind == "advance_score" and score_task:
                        progress.advance(score_task[0], payload)

                job = {"arm": arm, "llm_kwargs": llm_kwargs(plan, graft=(arm == "graft"), **overrides),
                       "workloads": wl_jobs if generate else [], "batch": args.batch, "repeat": args.repeat,
                       "ignore_eos": args.ignore_eos, "log_path": str(workdir / f"{arm}.log"),
                       "score_own": score and generate, "workloads_by_name": by_name, "score": {}}
                if score and "graft" in results:
                    for ps in prompt_sets:
                        for p, r in zip(ps.prompts, results["graft"]["workloads"][ps.name]["requests"]):
                            job["score"][f"graft/{ps.name}/{p.index}"] = (list(p.token_ids), r["output_token_ids"])
                raw = _run_child(job, workdir, on_event, timeout=args.timeout or None)
                progress.update(task, description=f"{label}: done")
                if generate:
                    results[arm] = raw
                if "scores" in raw:
                    scores = raw["scores"]
    except ArmFailed as e:
        err.print(f"[bold red]✗ the {e.arm} arm failed:[/] {escape(str(e))}")
        tail = _tail(e.log_path)
        if tail:
            err.print(f"[dim]last lines of {escape(e.log_path)}:[/]\n{escape(tail)}")
        err.print(f"full log: {escape(e.log_path)}")
        return EXIT_INVALID if e.error_type == "DeploymentError" else EXIT_RUN_FAILED
    wall = time.perf_counter() - t_start

    from vllm_graft.integration.env import installed_vllm

    found = installed_vllm()
    environment = {"python": sys.version.split()[0], "platform": platform.platform(),
                   "machine": platform.machine(), "cpu_count": os.cpu_count(),
                   "vllm": f"{found[0]} {found[1]}" if found else None,
                   "stdlib": str(W.stdlib_dir()), "vllm_platform": plan.platform}
    result = assemble(deployment=str(args.deployment),
                      plan_info={"model": plan.deployment.model, "plugins": plugins,
                                 "engine_args": plan.deployment.engine},
                      settings=settings, prompt_sets=prompt_sets, arm_results=results, scores=scores,
                      decode=tokenizer.decode, wall_s=wall, environment=environment)
    render_report(result, out)
    if args.json:
        text = json.dumps(result, indent=1, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
            out.print(f"JSON written to {escape(args.json)}")
    if args.plot:
        write_plot(result, args.plot)
        out.print(f"plot written to {escape(args.plot)}")
    out.print(f"[dim]bench wall time {wall:.1f} s; engine logs in {escape(str(workdir))}[/]" if keep_logs
              else f"[dim]bench wall time {wall:.1f} s[/]")
    if not keep_logs:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    cmp = result["comparison"]
    if args.require_identical and cmp is not None and not cmp["identical"]:
        return EXIT_DIFFERENT
    return EXIT_OK


# ============================================================================== parser
def add_command(sub: Any) -> None:
    from vllm_graft.tools.workloads import WORKLOADS

    p = sub.add_parser(
        "bench", help="A/B benchmark: plain vLLM vs the deployment on the same workloads",
        description="Run the same deterministic workloads through plain vLLM and through the "
                    "deployment (each in its own process, in-process engine, greedy decoding) and "
                    "report output tokens/s, time to first token, inter-token latency, peak KV "
                    "blocks in use, peak memory, whether greedy outputs are identical, and the "
                    "perplexity of the outputs under the unmodified model.",
        epilog=f"Workloads: {', '.join(WORKLOADS)} (--list-workloads describes them). Exit codes: "
               "0 ok, 1 invalid deployment (no engine started), 2 bad command line, 3 a plugin "
               "failed to load, 4 an engine run failed, 5 outputs differ (with --require-identical).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("deployment", nargs="?", help="deployment YAML file")
    p.add_argument("--workload", action="append", metavar="NAME[,NAME]",
                   help="workload(s) to run; repeatable or a comma list (default: all)")
    p.add_argument("--list-workloads", action="store_true", help="describe the built-in workloads and exit")
    p.add_argument("--num-prompts", type=int, default=8, metavar="N", help="prompts per workload (default 8)")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N",
                   help="output tokens per request (default 64; less where the context is full)")
    p.add_argument("--batch", type=int, default=0, metavar="N",
                   help="requests in flight at once; the next is submitted when one finishes "
                        "(default 0: all of a workload's requests at once)")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run each workload N times per engine and report the run with the median wall "
                        "time, with the tokens/s range (default 1)")
    p.add_argument("--seed", type=int, default=0, help="workload selection and engine seed (default 0)")
    p.add_argument("--arms", default="plain,graft", metavar="ARMS",
                   help="which arms to run: plain, graft or plain,graft (default both)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate max-tokens tokens even past <|endoftext|> (fixed output lengths)")
    p.add_argument("--no-ppl", action="store_true", help="skip scoring outputs under the unmodified model")
    p.add_argument("--json", metavar="FILE", help="write the full result as JSON ('-': stdout)")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of the figures")
    p.add_argument("--log-dir", metavar="DIR", help="keep the engines' logs and raw results here")
    p.add_argument("--timeout", type=float, default=0, metavar="S", help="give up on an arm after S seconds")
    p.add_argument("--require-identical", action="store_true",
                   help="exit 5 when the arms' greedy outputs differ")
    p.set_defaults(func=cmd_bench)
