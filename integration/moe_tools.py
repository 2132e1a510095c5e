"""`vllm-graft moe-trace` and `vllm-graft moe-sim`: routing traces from vLLM, and the MoE
simulations that run on them.

``moe-trace DEPLOYMENT --out T.npz`` runs the bench's deterministic workloads through vLLM with
the deployment's MoE plugins and the ``route-trace`` recorder (last in the list), writes the
trace (one segment per workload), and prints the perplexity of the workload prompts' own text
under the engine (teacher forcing) and what each plugin reported. ``--baseline`` runs the
same with plain vLLM routing first (the recorder only), writes that trace beside the first
(``T.plain.npz``) and prints the perplexity change: what a lossy router (``dynamic-topk``)
costs in quality.

``moe-sim T.npz`` prints the simulations of ``affinity-placement`` (all-to-all volume of
round-robin, linear and affinity placement on N devices, with a lower bound) and
``expert-cache`` (hit rate and bytes moved per token of LRU, LFU and affinity prefetch at
capacities C), fitting on the first half of every workload segment and evaluating on the rest.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def _trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("deployment", help="deployment YAML (its model and MoE plugins)")
    p.add_argument("--out", "-o", required=True, metavar="FILE.npz", help="trace file to write")
    p.add_argument("--workload", action="append", metavar="NAME[,NAME]", help="bench workloads (default: all)")
    p.add_argument("--num-prompts", type=int, default=8, metavar="N", help="prompts per workload (default 8)")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N", help="output tokens per prompt (default 64)")
    p.add_argument("--batch", type=int, default=0, metavar="N",
                   help="prompts per generate call (default 0: a workload's prompts at once; 1: one request at a time)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", action="store_true",
                   help="also record plain vLLM routing (T.plain.npz) and compare perplexity")
    p.add_argument("--no-ppl", action="store_true", help="skip scoring the prompts")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")


def cmd_trace(args: argparse.Namespace, console: Console) -> int:
    from vllm_graft.hooks import DeploymentError
    from vllm_graft.hooks.deployment import load_file

    from .cli import EXIT_INVALID, EXIT_OK, EXIT_USAGE
    from .launch import apply_env_defaults, load_plan
    from .moe_record import record, with_tracer, workload_sets
    from .run import _quiet_vllm
    from .workloads import WorkloadError

    if not args.out.endswith(".npz"):
        console.print("[bold red]error:[/] --out must end in .npz")
        return EXIT_USAGE
    try:
        plan = load_plan(args.deployment)
        data = load_file(args.deployment)
    except DeploymentError as e:
        console.print(f"[bold red]✗ {escape(e.source)}:[/]")
        for p in e.problems:
            console.print(f"  [red]•[/] {escape(str(p))}")
        return EXIT_INVALID
    model = plan.deployment.model
    data["model"] = model
    max_model_len = int(plan.deployment.engine.get("max_model_len", 2048))
    try:
        sets = workload_sets(model, args.workload, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                             max_model_len=max_model_len, seed=args.seed)
    except WorkloadError as e:
        console.print(f"[bold red]error:[/] {escape(str(e))}")
        return EXIT_USAGE
    _quiet_vllm()
    apply_env_defaults(in_process=True)
    base = Path(args.deployment).resolve().parent
    arms = []
    if args.baseline:
        arms.append(("plain", with_tracer(data, drop_moe=True), str(Path(args.out).with_suffix("")) + ".plain.npz"))
    arms.append(("deployment", with_tracer(data), args.out))
    recs = {}
    for label, d, out in arms:
        rec = record(d, base, sets, score=not args.no_ppl, batch=args.batch,
                     on_phase=lambda s, label=label: console.print(f"[dim]{label}: {escape(s)}[/]"))
        rec.trace.meta.update({"arm": label, "deployment": str(args.deployment), "workloads": [s.name for s in sets],
                               "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "batch": args.batch})
        rec.trace.save(out)
        console.print(f"{label}: {rec.trace.num_tokens} tokens x {rec.trace.num_layers} MoE layers "
                      f"(top-{rec.trace.top_k} of {rec.trace.num_experts}) -> {escape(out)} "
                      f"[dim]({rec.wall_s:.1f} s)[/]")
        recs[label] = rec
    result = _trace_report(recs, sets, console)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
    return EXIT_OK


def _trace_report(recs: dict[str, Any], sets: list[Any], console: Console) -> dict[str, Any]:
    result: dict[str, Any] = {"arms": {}}
    for label, rec in recs.items():
        result["arms"][label] = {"tokens": rec.trace.num_tokens, "wall_s": rec.wall_s,
                                 "perplexity": {s.name: rec.perplexity(s.name) for s in sets if s.name in rec.nll},
                                 "perplexity_all": rec.perplexity() if rec.nll else None,
                                 "plugins": [{"name": r["name"], "described": r["described"], "events": r["events"]}
                                             for r in rec.report if r["name"] != "route-trace"]}
    if any(rec.nll for rec in recs.values()):
        t = Table(title="perplexity of the workload prompts (teacher forcing, under each arm)", box=None)
        t.add_column("workload")
        for label in recs:
            t.add_column(label, justify="right")
        if len(recs) == 2:
            t.add_column("change", justify="right")
        for name in [s.name for s in sets] + [None]:
            vals = [rec.perplexity(name) for rec in recs.values()]
            row = [name or "all"] + [f"{v:.3f}" for v in vals]
            if len(vals) == 2:
                row.append(f"{100 * (vals[1] / vals[0] - 1):+.2f}%")
            t.add_row(*row)
        console.print(t)
        if len(recs) == 2:
            a, b = (rec.perplexity() for rec in recs.values())
            result["perplexity_change"] = b / a - 1
    for label, rec in recs.items():
        for r in rec.report:
            if r["name"] == "route-trace":
                continue
            described = ", ".join(f"{k}={v}" for k, v in r["described"].items()) or "-"
            console.print(f"{label}: moe:{r['name']}: {escape(described)}")
    return result


def add_command(sub: Any) -> None:
    p = sub.add_parser("moe-trace", help="record MoE routing traces from vLLM on the bench workloads",
                       description=__doc__.split("\n\n")[1])
    _trace_args(p)
    p.set_defaults(func=cmd_trace)
