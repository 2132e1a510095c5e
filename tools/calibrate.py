"""`vllm-graft calibrate METHOD ...`: offline calibration passes that write the files
plugins read.

Methods are a small table (:data:`METHODS`): each entry names the plugin it serves, adds its
own arguments and runs. ``expert-mask`` (MoTE) is the first; another method (e.g. the
retrieval-head probe of an attention plugin) adds one :class:`Method` entry here.

``calibrate expert-mask``: record the routes of two prompt sets in vLLM (behaviour A, e.g.
prose, and contrast B, e.g. code; prefill only), compare each layer's expert activation
frequencies, and write a mask switching off (or forcing on) the experts most distinctive for
A. ``--evaluate`` then measures the perplexity of both sets with and without the mask.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.markup import escape
from rich.table import Table


@dataclass(frozen=True)
class Method:
    name: str
    plugin: str  # "kind:name" of the plugin whose file it writes
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Console], int]


# ------------------------------------------------------------------------- expert-mask
DEFAULT_DEPLOYMENT = "moe-expert-mask.yaml"


def _mask_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--behaviour",
        "-a",
        required=True,
        metavar="FILE",
        help="prompts showing the behaviour (text with prompts separated by '---' lines, or a JSON list)",
    )
    p.add_argument("--contrast", "-b", required=True, metavar="FILE", help="contrast prompts (same format)")
    p.add_argument("--out", "-o", required=True, metavar="FILE.json", help="mask file to write")
    p.add_argument(
        "--deployment",
        metavar="FILE",
        help="deployment whose model (and other MoE plugins) to calibrate on (default: the bundled MoE model, fp32)",
    )
    p.add_argument("--top", type=int, default=4, help="experts to pick (default 4)")
    p.add_argument("--per-layer", action="store_true", help="pick --top experts in every layer")
    p.add_argument(
        "--action",
        choices=["off", "on"],
        default="off",
        help="switch the picked experts off (default) or force them on",
    )
    p.add_argument(
        "--contrast-method",
        choices=["diff", "log-ratio"],
        default="diff",
        help="f_A - f_B (default) or log((f_A+eps)/(f_B+eps))",
    )
    p.add_argument(
        "--evaluate", action="store_true", help="then measure both sets' perplexity with the mask vs without"
    )


def _deployment_data(path: str | None) -> tuple[dict[str, Any], Path]:
    from ..hooks.deployment import load_file

    from ..launch.engine import models_dir

    if path:
        return load_file(path), Path(path).resolve().parent
    return (
        {"model": str(models_dir() / "graft-tiny-mixtral"), "engine": {"dtype": "float32", "max_model_len": 2048}},
        Path.cwd(),
    )


def _calibration(args: argparse.Namespace, trace: Any, chosen: list[Any]) -> dict[str, Any]:
    """What the mask was calibrated on, written into the mask file."""
    return {
        "behaviour": str(args.behaviour),
        "contrast": str(args.contrast),
        "tokens": {
            "behaviour": trace.segment("behaviour").num_tokens,
            "contrast": trace.segment("contrast").num_tokens,
        },
        "method": args.contrast_method,
        "action": args.action,
        "picked": [
            {
                "layer": d.layer,
                "expert": d.expert,
                "freq_behaviour": round(d.freq_a, 4),
                "freq_contrast": round(d.freq_b, 4),
                "score": round(d.score, 4),
            }
            for d in chosen
        ],
    }


def _evaluate_mask(args: argparse.Namespace, data: dict[str, Any], base: Path, sets: Any, console: Console) -> None:
    """Both prompt sets' perplexity with the written mask and without; the change goes into the mask file."""
    from .moe.moe_record import record, with_tracer

    rows = []
    for label, d in (
        ("without mask", data),
        (
            "with mask",
            {**data, "moe": [{"plugin": "expert-mask", "params": {"mask_file": str(Path(args.out).resolve())}}]},
        ),
    ):

        def say(s: str, label: str = label) -> None:
            console.print(f"[dim]{label}: {escape(s)}[/]")

        r = record(with_tracer(d), base, sets, score=True, on_phase=say)
        pa, pb = r.perplexity("behaviour"), r.perplexity("contrast")
        assert pa is not None and pb is not None  # None only when no prompt token was scored
        rows.append((label, pa, pb))
    t = Table(title="perplexity of the prompts themselves (teacher forcing)", box=None)
    for col in ("", "behaviour", "contrast"):
        t.add_column(col, justify="right")
    for label, pa, pb in rows:
        t.add_row(label, f"{pa:.3f}", f"{pb:.3f}")
    (_, a0, b0), (_, a1, b1) = rows
    t.add_row("change", f"{100 * (a1 / a0 - 1):+.1f}%", f"{100 * (b1 / b0 - 1):+.1f}%")
    console.print(t)
    result = json.loads(Path(args.out).read_text())
    result.setdefault("calibration", {})["evaluation"] = {
        "perplexity_without": {"behaviour": a0, "contrast": b0},
        "perplexity_with": {"behaviour": a1, "contrast": b1},
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def _run_mask(args: argparse.Namespace, console: Console) -> int:
    from ..hooks import get_registry
    from ..launch.exits import EXIT_OK, EXIT_USAGE
    from ..launch.engine import apply_env_defaults, quiet_vllm
    from .moe.moe_record import read_prompt_file, record, text_sets, with_tracer

    policy = get_registry().get("moe", "expert-mask").registration.part("policy")
    activation_frequency, mask_from, most_distinctive = (
        policy.activation_frequency,
        policy.mask_from,
        policy.most_distinctive,
    )

    try:
        a_texts, b_texts = read_prompt_file(args.behaviour), read_prompt_file(args.contrast)
    except (OSError, ValueError) as e:
        console.print(f"[bold red]error:[/] {escape(str(e))}")
        return EXIT_USAGE
    if not a_texts or not b_texts:
        console.print("[bold red]error:[/] both prompt files need at least one prompt")
        return EXIT_USAGE
    if args.top < 1:
        console.print("[bold red]error:[/] --top must be at least 1")
        return EXIT_USAGE
    quiet_vllm()
    apply_env_defaults(in_process=True)
    data, base = _deployment_data(args.deployment)
    model = data.get("model")
    if model and not Path(model).is_absolute():
        model = str((base / model).resolve())
        data["model"] = model
    if not model:
        console.print(
            f"[bold red]error:[/] {escape(str(args.deployment))} names no model (its tokenizer tokenizes the prompts)"
        )
        return EXIT_USAGE
    sets = text_sets(model, {"behaviour": a_texts, "contrast": b_texts})
    rec = record(with_tracer(data), base, sets, score=False, on_phase=lambda s: console.print(f"[dim]{escape(s)}[/]"))
    trace = rec.trace
    freqs = {}
    for name in ("behaviour", "contrast"):
        part = trace.segment(name)
        freqs[name] = activation_frequency(part.counts().tolist(), part.num_tokens)
    E = trace.num_experts
    top_k = trace.top_k
    chosen = most_distinctive(
        freqs["behaviour"],
        freqs["contrast"],
        top=args.top,
        per_layer=args.per_layer,
        method=args.contrast_method,
        layers=trace.layers,
        max_per_layer=(E - top_k) if args.action == "off" else top_k,
    )
    if not chosen:
        console.print(
            "[yellow]no expert is used more by the behaviour prompts than by the contrast prompts: no mask written[/]"
        )
        return 1
    num_layers = max(trace.layers) + 1
    mask = mask_from(
        chosen,
        args.action,
        num_layers,
        E,
        calibration=_calibration(args, trace, chosen),
    )
    mask.save(args.out)
    table = Table(title=f"most distinctive experts for {args.behaviour} vs {args.contrast}", box=None)
    for col in ("layer", "expert", "freq A", "freq B", "score"):
        table.add_column(col, justify="right")
    for d in chosen:
        table.add_row(str(d.layer), str(d.expert), f"{d.freq_a:.3f}", f"{d.freq_b:.3f}", f"{d.score:+.3f}")
    console.print(table)
    console.print(f"mask ({args.action}) written to {escape(str(args.out))}")
    if args.evaluate:
        _evaluate_mask(args, data, base, sets, console)
    return EXIT_OK


#: The calibration methods, by name.
def _razor() -> Method:
    from .attention import calibrate_razor as razor

    return Method(razor.NAME, razor.PLUGIN, razor.HELP, razor.add_arguments, razor.run)


def _million() -> Method:
    from .kvcompress import calibrate_million as million

    return Method(million.NAME, million.PLUGIN, million.HELP, million.add_arguments, million.run)


def _xquant() -> Method:
    from .kvcompress import calibrate_xquant as xquant

    return Method(xquant.NAME, xquant.PLUGIN, xquant.HELP, xquant.add_arguments, xquant.run)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            "expert-mask",
            "moe:expert-mask",
            "find the experts most distinctive for a behaviour (two prompt sets) and write an expert mask",
            _mask_args,
            _run_mask,
        ),
        _razor(),  # RazorAttention retrieval heads -> the head map of attention:squeezed
        _million(),  # MILLION product-quantisation codebooks -> the codebook file of kvcompress:million
        _xquant(),  # XQuant's SVD bases of Wk, Wv -> the bases file of kvcompress:xquant
    )
}


def add_command(sub: Any) -> None:
    p = sub.add_parser(
        "calibrate",
        help="offline calibration passes that write a plugin's files",
        description="Offline calibration: " + "; ".join(f"{m.name} ({m.plugin}): {m.help}" for m in METHODS.values()),
    )
    methods = p.add_subparsers(dest="method", metavar="METHOD")
    for m in METHODS.values():
        mp = methods.add_parser(m.name, help=m.help, description=f"{m.help} (for {m.plugin})")
        m.add_arguments(mp)
        mp.set_defaults(func=m.run)
    p.set_defaults(func=_no_method)


def _no_method(args: argparse.Namespace, console: Console) -> int:
    console.print(f"[bold red]error:[/] name a calibration method: {', '.join(METHODS)}")
    return 2
