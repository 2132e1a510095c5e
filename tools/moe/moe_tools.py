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
capacities C), fitting on the first half of every workload segment and evaluating on the rest;
``--placement NAME`` / ``--cache NAME`` simulate another registered moe plugin's ``policy`` module
instead (a third party's too), where it has the same functions.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..command_line import tool_parser, write_json


def _trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("deployment", help="deployment YAML (its model and MoE plugins)")
    p.add_argument("--out", "-o", required=True, metavar="FILE.npz", help="trace file to write")
    p.add_argument("--workload", action="append", metavar="NAME[,NAME]", help="bench workloads (default: all)")
    p.add_argument("--num-prompts", type=int, default=8, metavar="N", help="prompts per workload (default 8)")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N", help="output tokens per prompt (default 64)")
    p.add_argument(
        "--batch",
        type=int,
        default=0,
        metavar="N",
        help="prompts per generate call (default 0: a workload's prompts at once; 1: one request at a time)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--baseline", action="store_true", help="also record plain vLLM routing (T.plain.npz) and compare perplexity"
    )
    p.add_argument("--no-ppl", action="store_true", help="skip scoring the prompts")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")


def cmd_trace(args: argparse.Namespace, console: Console) -> int:
    from ...hooks import DeploymentError
    from ...hooks.deployment import load_file

    from ...launch.exits import EXIT_INVALID, EXIT_OK, EXIT_USAGE
    from ...launch.engine import apply_env_defaults
    from ...integration.plan import plan_for
    from .moe_record import record, with_tracer, workload_sets
    from ...launch.engine import quiet_vllm
    from ..workloads import WorkloadError

    if not args.out.endswith(".npz"):
        console.print("[bold red]error:[/] --out must end in .npz")
        return EXIT_USAGE
    try:
        plan = plan_for(args.deployment)
        data = load_file(args.deployment)
    except DeploymentError as e:
        console.print(f"[bold red]✗ {escape(e.source)}:[/]")
        for p in e.problems:
            console.print(f"  [red]•[/] {escape(str(p))}")
        return EXIT_INVALID
    model = plan.deployment.model
    if model is None:
        console.print(
            f"[bold red]error:[/] {escape(str(args.deployment))} names no model (its tokenizer makes the prompts)"
        )
        return EXIT_INVALID
    data["model"] = model
    max_model_len = int(plan.deployment.engine.get("max_model_len", 2048))
    try:
        sets = workload_sets(
            model,
            args.workload,
            num_prompts=args.num_prompts,
            max_tokens=args.max_tokens,
            max_model_len=max_model_len,
            seed=args.seed,
        )
    except WorkloadError as e:
        console.print(f"[bold red]error:[/] {escape(str(e))}")
        return EXIT_USAGE
    quiet_vllm()
    apply_env_defaults(in_process=True)
    base = Path(args.deployment).resolve().parent
    arms = []
    if args.baseline:
        arms.append(("plain", with_tracer(data, drop_moe=True), str(Path(args.out).with_suffix("")) + ".plain.npz"))
    arms.append(("deployment", with_tracer(data), args.out))
    recs = {}
    for label, d, out in arms:

        def say(s: str, label: str = label) -> None:
            console.print(f"[dim]{label}: {escape(s)}[/]")

        rec = record(d, base, sets, score=not args.no_ppl, batch=args.batch, on_phase=say)
        rec.trace.meta.update(
            {
                "arm": label,
                "deployment": str(args.deployment),
                "workloads": [s.name for s in sets],
                "num_prompts": args.num_prompts,
                "max_tokens": args.max_tokens,
                "batch": args.batch,
            }
        )
        rec.trace.save(out)
        console.print(
            f"{label}: {rec.trace.num_tokens} tokens x {rec.trace.num_layers} MoE layers "
            f"(top-{rec.trace.top_k} of {rec.trace.num_experts}) -> {escape(out)} "
            f"[dim]({rec.wall_s:.1f} s)[/]"
        )
        recs[label] = rec
    result = _trace_report(recs, sets, console)
    write_json(args.json, result, default=str)
    return EXIT_OK


def _trace_report(recs: dict[str, Any], sets: list[Any], console: Console) -> dict[str, Any]:
    result: dict[str, Any] = {"arms": {}}
    for label, rec in recs.items():
        result["arms"][label] = {
            "tokens": rec.trace.num_tokens,
            "wall_s": rec.wall_s,
            "perplexity": {s.name: rec.perplexity(s.name) for s in sets if s.name in rec.nll},
            "perplexity_all": rec.perplexity() if rec.nll else None,
            "plugins": [
                {"name": r["name"], "described": r["described"], "events": r["events"]}
                for r in rec.report
                if r["name"] != "route-trace"
            ],
        }
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
    help = "record MoE routing traces from vLLM on the bench workloads"
    _trace_args(tool_parser(sub, "moe-trace", help, cmd_trace, __doc__, slice(1, 2)))
    help = "expert placement and expert cache simulations on a routing trace"
    _sim_args(tool_parser(sub, "moe-sim", help, cmd_sim, __doc__, slice(2, 3)))


# =============================================================================== moe-sim
def _sim_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="routing trace (.npz from moe-trace)")
    p.add_argument("--devices", default="2,4,8", metavar="N[,N]", help="expert-parallel device counts (default 2,4,8)")
    p.add_argument("--capacity", metavar="C[,C]", help="experts resident per layer (default: E/4 and E/2)")
    p.add_argument("--prefetch", default="1,2", metavar="P[,P]", help="affinity prefetch depths (default 1,2)")
    p.add_argument(
        "--fit-fraction",
        type=float,
        default=0.5,
        help="fit placement affinity on this share of every workload segment, evaluate on the rest (default 0.5)",
    )
    p.add_argument("--expert-bytes", type=int, help="bytes of one expert (default: from the model's config.json)")
    p.add_argument("--place-out", metavar="FILE.json", help="write the affinity placement for --place-devices here")
    p.add_argument("--place-devices", type=int, default=4, help="devices of the written placement (default 4)")
    p.add_argument(
        "--placement",
        default="affinity-placement",
        metavar="NAME",
        help="the moe plugin whose policy module is simulated for placement (default "
        "affinity-placement; any registered moe plugin, a third party's too, with the same "
        "functions: " + ", ".join(PLACEMENT_API) + ")",
    )
    p.add_argument(
        "--cache",
        default="expert-cache",
        metavar="NAME",
        help="the moe plugin whose policy module is simulated for the expert cache (default "
        "expert-cache; any registered moe plugin with " + ", ".join(CACHE_API) + ")",
    )
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")


#: What moe-sim calls in a plugin's ``policy`` module (pure Python, no tensors): the
#: placement simulation's and the cache simulation's functions, as the built-ins
#: ``affinity-placement`` and ``expert-cache`` define them.
PLACEMENT_API = ("affinity", "solve", "volume", "round_robin", "linear", "lower_bound")
CACHE_API = ("POLICIES", "sets_from_trace", "simulate")


def _simulator(name: str, what: str, api: tuple[str, ...]) -> Any:
    """The ``policy`` module of the registered moe plugin ``name`` (a third party's too), if it
    has the functions of ``api``; else an error naming the moe plugins that do."""
    from ...hooks import get_registry
    from ..plugin_args import PluginArgError, registration

    def module(reg: Any) -> Any:
        try:
            mod = reg.part("policy")
        except ImportError:
            return None
        return mod if all(hasattr(mod, f) for f in api) else None

    mod = module(registration("moe", name))
    if mod is None:
        able = [e.name for e in get_registry().entries("moe") if module(e.registration) is not None]
        raise PluginArgError(
            f"--{what} {name}: the moe plugin has no policy module with {', '.join(api)} "
            f"(what moe-sim's {what} simulation calls); moe plugins that have: {', '.join(able)}"
        )
    return mod


def _ints(text: str | None) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()] if text else []


def expert_bytes_of(model: str | None) -> int | None:
    """One expert's weight bytes (gate, up and down projections) from a model folder's config."""
    if not model:
        return None
    cfg = Path(model) / "config.json"
    if not cfg.is_file():
        return None
    c = json.loads(cfg.read_text())
    H = c.get("hidden_size")
    I = c.get("moe_intermediate_size") or c.get("intermediate_size")
    size = {"float16": 2, "bfloat16": 2, "float32": 4}.get(str(c.get("torch_dtype") or c.get("dtype")), 2)
    return 3 * H * I * size if H and I else None


def _placement_table(args: argparse.Namespace, console: Console, trace: Any, P: Any, result: dict[str, Any]) -> None:
    """moe-sim's placement half: fit each solver on part of the trace, count the cross-device
    transfers per token on the rest; the rows go to ``result["placement"]``."""
    L, E = trace.num_layers, trace.num_experts
    devices = _ints(args.devices)
    fit, held = trace.split(args.fit_fraction)
    A_fit, A_held = P.affinity(fit.token_sets()), P.affinity(held.token_sets())
    n_held = held.num_tokens
    t = Table(
        title=f"affinity placement: cross-device transfers per token (fit on {fit.num_tokens} tokens, "
        f"evaluated on the other {n_held})",
        box=None,
    )
    for col in (
        "devices",
        "round-robin",
        "linear",
        "affinity",
        "lower bound",
        "vs round-robin",
        "solver",
        "in-sample vs rr",
    ):
        t.add_column(col, justify="right")
    for N in devices:
        if N == 1:
            continue
        sol = P.solve(A_fit, N)
        assert not sol.placement.problems(E // N)
        rr, lin = P.volume(A_held, P.round_robin(L, E, N)), P.volume(A_held, P.linear(L, E, N))
        aff = P.volume(A_held, sol.placement)
        lb = P.lower_bound(A_held, N)
        rr_fit = P.volume(A_fit, P.round_robin(L, E, N))
        row = {
            "devices": N,
            "round_robin": rr / n_held,
            "linear": lin / n_held,
            "affinity": aff / n_held,
            "lower_bound": lb / n_held,
            "reduction_vs_round_robin": 1 - aff / rr if rr else 0.0,
            "solver": sol.method,
            "in_sample_reduction": 1 - sol.volume / rr_fit if rr_fit else 0.0,
            "in_sample_gap_to_bound": (sol.volume - sol.lower_bound) / sol.volume if sol.volume else 0.0,
        }
        result["placement"].append(row)
        t.add_row(
            str(N),
            f"{row['round_robin']:.3f}",
            f"{row['linear']:.3f}",
            f"{row['affinity']:.3f}",
            f"{row['lower_bound']:.3f}",
            f"{-100 * row['reduction_vs_round_robin']:+.1f}%",
            sol.method,
            f"{-100 * row['in_sample_reduction']:+.1f}%",
        )
        if args.place_out and N == args.place_devices:
            full = P.solve(P.affinity(trace.token_sets()), N)
            full.placement.save(
                args.place_out,
                trace.layers,
                {
                    "fitted_on": args.trace,
                    "solver": full.method,
                    "volume": full.volume,
                    "lower_bound": full.lower_bound,
                },
            )
    console.print(t)
    if args.place_out:
        console.print(
            f"placement for {args.place_devices} devices (fitted on the whole trace) written to "
            f"{escape(args.place_out)}"
        )


def _cache_table(
    console: Console, trace: Any, cache: Any, caps: list[int], prefetch: list[int], eb: Any, result: dict[str, Any]
) -> None:
    """moe-sim's cache half: each policy's hit rate per capacity, in the engine's token order;
    the rows go to ``result["cache"]``."""
    POLICIES, sets_from_trace, simulate = cache.POLICIES, cache.sets_from_trace, cache.simulate
    E = trace.num_experts
    sets = sets_from_trace(trace)
    t = Table(title=f"expert cache: {trace.num_tokens} tokens in the engine's order, every MoE layer", box=None)
    for col in ("capacity", "policy", "hit rate", "loads/token", "MiB/token" if eb else "", "prefetch used"):
        t.add_column(col, justify="right")
    for C in caps:
        runs = [("lru", 0), ("lfu", 0)] + [("affinity", p) for p in prefetch if 1 <= p <= C] + [("belady", 0)]
        for pol, pf in runs:
            assert pol in POLICIES
            st = simulate(sets, E, C, pol, pf)
            row = {
                "capacity": C,
                "policy": pol,
                "prefetch": pf,
                "hit_rate": st.hit_rate,
                "loads_per_token": st.loads / st.tokens,
                "bytes_per_token": st.bytes_per_token(eb) if eb else None,
                "prefetch_loads": st.prefetch_loads,
                "prefetch_used": st.prefetch_used,
            }
            result["cache"].append(row)
            name = {"affinity": f"affinity prefetch {pf}", "belady": "belady (oracle, no prefetch)"}.get(pol, pol)
            t.add_row(
                f"{C}/{E}",
                name,
                f"{st.hit_rate:.3f}",
                f"{row['loads_per_token']:.2f}",
                f"{row['bytes_per_token'] / 2**20:.2f}" if eb else "",
                f"{st.prefetch_used}/{st.prefetch_loads}" if pf else "-",
            )
    console.print(t)


def cmd_sim(args: argparse.Namespace, console: Console) -> int:
    from ...hooks import get_registry
    from ...launch.exits import EXIT_OK, EXIT_USAGE

    from ..plugin_args import PluginArgError

    try:
        P = _simulator(getattr(args, "placement", None) or "affinity-placement", "placement", PLACEMENT_API)
        cache = _simulator(getattr(args, "cache", None) or "expert-cache", "cache", CACHE_API)
    except PluginArgError as e:
        console.print(f"[bold red]error:[/] {escape(str(e))}")
        return EXIT_USAGE
    traces = get_registry().get("moe", "route-trace").registration.part("reference")
    Trace, TraceError = traces.Trace, traces.TraceError

    try:
        trace = Trace.load(args.trace)
        devices, caps, prefetch = _ints(args.devices), _ints(args.capacity), _ints(args.prefetch)
    except (TraceError, ValueError) as e:
        console.print(f"[bold red]error:[/] {escape(str(e))}")
        return EXIT_USAGE
    L, E, k = trace.num_layers, trace.num_experts, trace.top_k
    bad = [n for n in devices if n < 1 or E % n]
    if bad:
        console.print(f"[bold red]error:[/] --devices {bad}: {E} experts do not split evenly over them")
        return EXIT_USAGE
    caps = caps or sorted({max(k, E // 4), max(k, E // 2)})
    if any(c < k or c > E for c in caps):
        console.print(f"[bold red]error:[/] --capacity values must be in {k}..{E} (top-{k} of {E} experts)")
        return EXIT_USAGE
    eb = args.expert_bytes or expert_bytes_of(trace.meta.get("model"))
    console.print(
        f"trace {escape(args.trace)}: {trace.num_tokens} tokens, {L} MoE layers {trace.layers}, "
        f"top-{k} of {E} experts, segments {[s[0] for s in trace.segments]}"
        + (f"; expert = {eb / 1024:.0f} KiB" if eb else "")
    )
    result: dict[str, Any] = {
        "trace": args.trace,
        "tokens": trace.num_tokens,
        "layers": L,
        "experts": E,
        "top_k": k,
        "expert_bytes": eb,
        "placement": [],
        "cache": [],
    }

    if not 0 < args.fit_fraction < 1:
        console.print(f"[bold red]error:[/] --fit-fraction must be between 0 and 1 (got {args.fit_fraction})")
        return EXIT_USAGE
    _placement_table(args, console, trace, P, result)
    _cache_table(console, trace, cache, caps, prefetch, eb, result)
    write_json(args.json, result)
    return EXIT_OK
