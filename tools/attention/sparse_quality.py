"""`vllm-graft sparse-quality`: perplexity and attention KV read of sparse decode attention
(`squeezed`) versus plain vLLM, and versus the sink + window baseline at the same budget.
(``--plugin NAME --params JSON``: any registered attention plugin against plain vLLM instead.)

Each arm is a vLLM CPU engine on the bundled dense model scoring a long-prompt workload with
``prompt_logprobs``: ``long-context`` (default: ~1800-token windows of stdlib Python source,
tokens from ``--score-from`` on scored) or ``long-recall`` (~1800-token windows whose last few
hundred tokens repeat a function from at least half the prompt back; only the repeat is scored,
so the score needs retrieval from the middle of the context), or ``shared-prefix``. The plugin arms run with
``prefill: sparse``: every prompt token attends exactly as it would if it were being decoded
(teacher forcing), so the perplexity is that of decoding with sparse attention; plain vLLM
gives the reference perplexity. KV read is what the plugin counted over those rows (attended
token-heads, plus the chunk centroids it scored, a centroid counted as half a token-head)
divided by what full attention reads. Fidelity to plain vLLM, token by token: the mean
absolute change of each scored token's negative log-likelihood, and how often the most likely
next token is the one plain vLLM predicts (perplexity alone can improve by accident: the bundled
model predicts code mostly from the recent tokens).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..command_line import tool_parser


def _recycled_refresh() -> int:
    """Mode recycled's full-step interval when ``refresh`` is not given: what squeezed's
    parameter model sets (read through the registry)."""
    from ...hooks import get_registry

    params = get_registry().get("attention", "squeezed").registration.params
    recycled: Any = params(mode="recycled")  # squeezed's own model, known only through the registry
    return recycled.refresh


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Fills in squeezed's default refresh only when the help is shown: building the CLI's
    parser reads no plugin."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = super()._get_help_string(action)
        if text and "{recycled_refresh}" in text:
            text = text.replace("{recycled_refresh}", str(_recycled_refresh()))
        return text


def _floats(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {text!r}") from None
    if not out or any(not 0 < x <= 1 for x in out):
        raise argparse.ArgumentTypeError(f"budgets are fractions in (0, 1], got {text!r}")
    return out


def _arms(args: argparse.Namespace) -> list[tuple[str, dict[str, Any] | None]]:
    """``(label, the plugin's parameters)`` per arm; ``None``: plain vLLM. ``--plugin`` other
    than squeezed: plain vLLM and that plugin with ``--params`` (squeezed's modes and budgets
    do not apply). For squeezed, ``--params`` go under every arm's own."""
    from ..plugin_args import parse_json_params, validate

    arms: list[tuple[str, dict[str, Any] | None]] = [("plain vLLM", None)]
    plugin = getattr(args, "plugin", None) or "squeezed"
    extra = parse_json_params(getattr(args, "params", None))
    if plugin != "squeezed":
        return arms + [(plugin, validate("attention", plugin, extra))]
    base = {"chunk": args.chunk, "sink_tokens": args.sink, "recent_tokens": args.recent, "prefill": "sparse"}
    # with a head map, each selection mode also runs with it: retrieval heads choose, the others keep the window
    maps: list[tuple[str, dict[str, Any]]] = [("", {})] + (
        [("+heads", {"head_map": args.head_map})] if args.head_map else []
    )
    for b in args.budget:
        for mode in [m for m in args.modes.split(",") if m]:
            for tag, hm in maps if mode in ("centroid", "recycled") else maps[:1]:
                if mode == "recycled":  # a full step every `refresh` positions (the plugin's default 16)
                    params = {
                        **base,
                        "mode": mode,
                        "budget": b,
                        **hm,
                        **({"refresh": args.refresh} if args.refresh > 1 else {}),
                    }
                    refresh = args.refresh if args.refresh > 1 else _recycled_refresh()
                    arms.append((f"recycled{tag} K={b:g} refresh {refresh}", params))
                    continue
                arms.append((f"{mode}{tag} K={b:g}", {**base, "mode": mode, "budget": b, **hm}))
                if mode == "centroid" and args.refresh > 1:
                    arms.append(
                        (
                            f"centroid{tag} K={b:g} refresh {args.refresh}",
                            {**base, "mode": mode, "budget": b, "refresh": args.refresh, **hm},
                        )
                    )
    if args.head_map:
        arms.append(("streaming-heads", {**base, "mode": "streaming-heads", "head_map": args.head_map}))
    if not extra:  # the deployment validates the arms' own parameters when each engine starts
        return arms
    return [(name, None if p is None else validate("attention", plugin, {**p, **extra})) for name, p in arms]


def _top1(entry: Any) -> int:
    """The most likely token at a position, from a ``prompt_logprobs`` entry (rank 1)."""
    return next(t for t, lp in entry.items() if getattr(lp, "rank", None) == 1)


def fidelity(plain: dict[str, Any], arm: dict[str, Any]) -> dict[str, float]:
    """How close an arm's predictions are to plain vLLM's, token by token: the mean absolute
    change of the scored tokens' NLL, and how often the most likely next token is the same."""
    a, b = plain["nll_per_token"], arm["nll_per_token"]
    same = sum(x == y for x, y in zip(plain["top1"], arm["top1"]))
    return {
        "mean_abs_dnll": sum(abs(x - y) for x, y in zip(a, b)) / len(a),
        "top1_agreement": same / len(plain["top1"]),
    }


#: Shortest prompt (tokens) a workload needs here: sparse attention only differs from full
#: attention far beyond the sinks and the recent window.
MIN_PROMPT_TOKENS = 1024


def load_workload(
    name: str, tok: Any, args: argparse.Namespace
) -> tuple[list[list[int]], list[tuple[int, int]], list[tuple[int, int]] | None]:
    """The prompts of a bench workload, the span of each that is scored (the workload's own
    ``scored_spans`` where it has them (long-recall), else from ``--score-from`` to the end) and,
    for long-recall, the spans of the first copies (what plain vLLM scores on the same tokens
    with nothing earlier to recall: how much the recall is worth to the model).
    Workloads with prompts shorter than MIN_PROMPT_TOKENS are refused (before any engine)."""
    from .. import workloads

    (ps,) = workloads.build(
        [name], tok, num_prompts=args.num_prompts, max_tokens=16, max_model_len=args.max_model_len, seed=args.seed
    )
    prompts = [list(p.token_ids) for p in ps.prompts]
    if min(map(len, prompts)) < MIN_PROMPT_TOKENS:
        raise workloads.WorkloadError(
            f"sparse-quality: workload {name!r} has prompts of {min(map(len, prompts))}-"
            f"{max(map(len, prompts))} tokens; it needs prompts of at least {MIN_PROMPT_TOKENS} tokens "
            "(sparse attention only differs from full attention far beyond the sinks and the recent "
            "window): use long-context, long-recall or shared-prefix"
        )
    if "scored_spans" in ps.stats:
        spans = [(a, b) for a, b in ps.stats["scored_spans"]]
        firsts = [(a - d, b - d) for (a, b), d in zip(spans, ps.stats["recall_distance"])]
        return prompts, spans, firsts
    else:
        if args.score_from >= min(map(len, prompts)):
            raise workloads.WorkloadError(
                f"sparse-quality: --score-from {args.score_from} is beyond the "
                f"shortest prompt ({min(map(len, prompts))} tokens)"
            )
        spans = [(args.score_from, len(p)) for p in prompts]
    return prompts, spans, None


def run_arm(
    model: str,
    engine: dict[str, Any],
    params: dict[str, Any] | None,
    prompts: list[list[int]],
    spans: list[tuple[int, int]],
    firsts: list[tuple[int, int]] | None = None,
    plugin: str = "squeezed",
) -> dict[str, Any]:
    from vllm import SamplingParams

    from ...launch import engine as launch
    from ...integration.plan import plan_for
    from ..bench import nll_of
    from ...integration.runtime import RUNTIME

    data: dict[str, Any] = {"model": model, "engine": engine, "attention": {"plugin": plugin, "params": params or {}}}
    plan = plan_for(data)
    with launch.in_process_engine(plan, graft=params is not None, seed=0) as llm:
        res = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
            use_tqdm=False,
        )
        nll = [x for r, p, (a, b) in zip(res, prompts, spans) for x in nll_of(r.prompt_logprobs, p[:b], a)]
        top1 = [_top1(r.prompt_logprobs[j]) for r, (a, b) in zip(res, spans) for j in range(a, b)]
        out: dict[str, Any] = {
            "tokens": len(nll),
            "nll": sum(nll) / len(nll),
            "ppl": math.exp(sum(nll) / len(nll)),
            "nll_per_token": nll,
            "top1": top1,
        }
        if firsts is not None and params is None:
            first = [x for r, p, (a, b) in zip(res, prompts, firsts) for x in nll_of(r.prompt_logprobs, p[:b], a)]
            out["first_copy_ppl"] = math.exp(sum(first) / len(first))
        if params is not None:
            impl = next(iter(RUNTIME.instances.values()))
            out["describe"] = impl.describe() or {}
            out["kv_read_fraction"] = out["describe"].get("kv_read_fraction")  # squeezed counts it
    return out


def cmd_sparse_quality(args: argparse.Namespace, console: Console) -> int:
    from ...launch import engine as launch
    from .. import workloads

    launch.apply_env_defaults(in_process=True)
    model = args.model or str(launch.models_dir() / "graft-tiny-llama")
    engine = {
        "dtype": "float32",
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
        "enforce_eager": True,
    }
    tok = workloads.Tokenizer.from_model(model)
    try:
        prompts, spans, firsts = load_workload(args.workload, tok, args)
    except workloads.WorkloadError as e:
        from rich.markup import escape

        Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {escape(str(e))}")
        return 2
    from ..plugin_args import PluginArgError

    try:  # the plugin and its parameters validated before any engine starts
        arms = _arms(args)
    except PluginArgError as e:
        from rich.markup import escape

        Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {escape(str(e))}")
        return 2
    scored = "the repeated span" if args.workload == "long-recall" else f"tokens from position {args.score_from}"
    results = []
    progress = Console(stderr=True, highlight=False) if args.json == "-" else console
    for name, params in arms:
        progress.print(f"[dim]{name}...[/]")
        r = run_arm(model, engine, params, prompts, spans, firsts, plugin=args.plugin)
        results.append({"arm": name, "params": params, **r})
    plain = results[0]["ppl"]
    for r in results:
        r.update(fidelity(results[0], r))
    for r in results:
        del r["nll_per_token"], r["top1"]
    if args.json:
        text = json.dumps(
            {
                "workload": args.workload,
                "prompts": len(prompts),
                "prompt_tokens": [len(p) for p in prompts],
                "score_from": args.score_from,
                "scored_spans": spans,
                "first_copy_spans": firsts,
                "arms": results,
            },
            indent=1,
        )
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    t = Table(
        title=f"Sparse decode attention on {args.workload} ({len(prompts)} prompts of "
        f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {scored} scored "
        f"({sum(b - a for a, b in spans)} tokens); chunk {args.chunk}, sinks {args.sink}, recent {args.recent})"
    )
    for col in ("arm", "perplexity", "change", "mean |dNLL|", "top-1 same as plain", "KV read"):
        t.add_column(col, justify="right" if col != "arm" else "left")
    if "first_copy_ppl" in results[0]:
        t.add_row(
            "plain vLLM, the same tokens at their first copy (nothing to recall)",
            f"{results[0]['first_copy_ppl']:.3f}",
            "",
            "",
            "",
            "",
        )
    for r in results:
        frac = r.get("kv_read_fraction")
        t.add_row(
            r["arm"],
            f"{r['ppl']:.3f}",
            f"{(r['ppl'] / plain - 1) * 100:+.2f}%",
            f"{r['mean_abs_dnll']:.4f}",
            f"{r['top1_agreement'] * 100:.1f}%",
            f"{frac * 100:.1f}%" if frac is not None else "100%" if r["params"] is None else "-",
        )
    console.print(t)
    return 0


def add_command(sub: Any) -> None:
    p = tool_parser(
        sub,
        "sparse-quality",
        "perplexity and KV read of sparse decode attention vs plain vLLM and the sink+window baseline",
        cmd_sparse_quality,
        __doc__,
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--model", help="model folder (default: the bundled graft-tiny-llama)")
    p.add_argument(
        "--plugin",
        default="squeezed",
        metavar="NAME",
        help="the attention plugin measured (default squeezed); any registered attention plugin "
        "(a third party's too): plain vLLM against it with --params (the squeezed options "
        "below do not apply; KV read is shown where its describe() reports kv_read_fraction)",
    )
    p.add_argument(
        "--params",
        metavar="JSON",
        help="the plugin's parameters, validated by its parameter model (squeezed: over every "
        "arm's own, e.g. '{\"sink_tokens\": 32}')",
    )
    p.add_argument(
        "--workload",
        default="long-context",
        metavar="NAME",
        help="bench workload with prompts of at least 1024 tokens: long-context (default), "
        "long-recall (only the repeated function is scored) or shared-prefix",
    )
    p.add_argument("--num-prompts", type=int, default=4, metavar="N", help="prompts (default 4)")
    p.add_argument(
        "--budget",
        type=_floats,
        default=[0.25, 0.125],
        metavar="F[,F]",
        help="fractions of the context attended (default 0.25,0.125)",
    )
    p.add_argument(
        "--modes",
        default="centroid,window",
        help="squeezed modes to run at each budget: centroid, recycled, window (default centroid,window; '' for none)",
    )
    p.add_argument(
        "--refresh",
        type=int,
        default=1,
        metavar="N",
        help="also run mode centroid choosing chunks only every N positions (default 1: off); "
        "mode recycled's full-step interval (default {recycled_refresh})",
    )
    p.add_argument(
        "--head-map",
        help="also run mode streaming-heads with this head map, and each "
        "selection mode of --modes with it (arms '+heads': its retrieval heads choose chunks, "
        "the other heads keep the sink + window at the same budget)",
    )
    p.add_argument("--chunk", type=int, default=16, help="chunk tokens (default 16)")
    p.add_argument("--sink", type=int, default=16, help="sink tokens (default 16)")
    p.add_argument("--recent", type=int, default=64, help="recent-window tokens (default 64)")
    p.add_argument(
        "--score-from",
        type=int,
        default=256,
        metavar="POS",
        help="score tokens from this position on (default 256; long-recall scores its repeated span)",
    )
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON ('-': stdout only)")
