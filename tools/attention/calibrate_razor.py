"""RazorAttention head classification (Tang et al., "RazorAttention: Efficient KV Cache
Compression Through Retrieval Heads", arXiv:2407.15891): find the retrieval heads of a model
with the repeated-random-token probe and write the head map that `squeezed`'s
``mode: streaming-heads`` reads (full attention for retrieval heads; sinks + recent window for
the others).

Probe: a sequence of ``--probe-len`` random tokens, repeated ``--repeats`` times. On the
repeats, for each query head (attention weights from transformers' eager attention):

* **echo score**: the mean attention from a token to the earlier occurrence(s) of the same token;
* **induction score**: the mean attention to the token(s) that *followed* its earlier
  occurrence(s) (what an induction head copies from).

Heads in the top ``--induction-fraction`` by induction score, or in the top
``--echo-fraction`` by echo score, are retrieval heads; a KV head is kept whole when any of
the query heads sharing it is one (the KV cache is per KV head). Averaged over ``--seeds``
probes. Run as ``vllm-graft calibrate razor --out FILE`` (an entry of the method table in
:mod:`.calibrate`: ``NAME``, ``PLUGIN``, ``HELP``, ``add_arguments(parser)``, ``run``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

NAME = "razor"
PLUGIN = "attention:squeezed"
HELP = "RazorAttention: find retrieval heads (echo/induction probe) and write a head map for squeezed"


def probe_scores(model: Any, vocab: int, probe_len: int, repeats: int, seed: int):
    """``(echo, induction)``, each [layers, heads] float tensors, for one random probe."""
    import torch

    g = torch.Generator().manual_seed(seed)
    # Distinct tokens (no repeats inside one copy), avoiding the special token 0.
    base = torch.randperm(vocab - 1, generator=g)[:probe_len] + 1
    ids = base.repeat(repeats).unsqueeze(0)
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True)
    n = ids.shape[1]
    pos = torch.arange(probe_len, n)  # queries in the repeats
    echo, induction = [], []
    for att in out.attentions:  # [1, H, n, n] per layer
        a = att[0].float()
        e = torch.zeros(a.shape[0])
        i = torch.zeros(a.shape[0])
        for q in pos.tolist():
            prev = list(range(q % probe_len, q, probe_len))  # earlier occurrences of the token
            nxt = [p + 1 for p in prev if p + 1 < q]
            e += a[:, q, prev].sum(-1)
            i += a[:, q, nxt].sum(-1) if nxt else 0.0
        echo.append(e / len(pos))
        induction.append(i / len(pos))
    return torch.stack(echo), torch.stack(induction)


def classify(echo, induction, num_kv_heads: int, induction_fraction: float, echo_fraction: float):
    """Retrieval heads: ``(per query head bool [L, H], per KV head list[list[bool]])``."""
    import torch

    layers, heads = echo.shape
    total = layers * heads
    chosen = torch.zeros(total, dtype=torch.bool)
    for scores, frac in ((induction, induction_fraction), (echo, echo_fraction)):
        k = math.ceil(frac * total) if frac > 0 else 0
        if k:
            chosen[torch.topk(scores.flatten(), k).indices] = True
    chosen = chosen.view(layers, heads)
    group = heads // num_kv_heads
    kv = chosen.view(layers, num_kv_heads, group).any(-1)
    return chosen, kv.tolist()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model folder (default: the bundled graft-tiny-llama)")
    p.add_argument("--out", required=True, metavar="FILE", help="head-map file to write (JSON)")
    p.add_argument("--probe-len", type=int, default=128, metavar="N", help="random tokens per copy (default 128)")
    p.add_argument("--repeats", type=int, default=3, metavar="R", help="copies in the probe (default 3)")
    p.add_argument("--seeds", type=int, default=3, metavar="S", help="probes averaged (default 3)")
    for kind, default in (("induction", 0.15), ("echo", 0.05)):  # classify's two head kinds
        p.add_argument(
            f"--{kind}-fraction",
            type=float,
            default=default,
            metavar="F",
            help=f"fraction of query heads kept as {kind} heads (default {default})",
        )
    p.add_argument("--json", action="store_true", help="print the head map as JSON")


def run(args: argparse.Namespace, console: Console) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ...hooks import get_registry
    from ...launch.engine import models_dir

    HEAD_MAP_FORMAT = get_registry().get("attention", "squeezed").registration.part("policy").HEAD_MAP_FORMAT

    for name in ("induction_fraction", "echo_fraction"):
        if not 0 <= getattr(args, name) <= 1:
            console.print(f"[red]--{name.replace('_', '-')} must be between 0 and 1[/]")
            return 2
    if args.probe_len < 2 or args.repeats < 2 or args.seeds < 1:
        console.print("[red]--probe-len and --repeats must be at least 2, --seeds at least 1[/]")
        return 2
    model_dir = args.model or str(models_dir() / "graft-tiny-llama")
    cfg = AutoConfig.from_pretrained(model_dir)
    if args.probe_len * args.repeats > cfg.max_position_embeddings:
        console.print(
            f"[red]the probe ({args.probe_len} x {args.repeats} tokens) is longer than the "
            f"model's {cfg.max_position_embeddings} positions[/]"
        )
        return 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    echo = induction = None
    for s in range(args.seeds):
        e, i = probe_scores(model, cfg.vocab_size, args.probe_len, args.repeats, seed=s)
        echo = e if echo is None else echo + e
        induction = i if induction is None else induction + i
    echo, induction = echo / args.seeds, induction / args.seeds
    kv_heads = cfg.num_key_value_heads
    chosen, retrieval = classify(echo, induction, kv_heads, args.induction_fraction, args.echo_fraction)
    data = {
        "format": HEAD_MAP_FORMAT,
        "model": Path(model_dir).name,
        "retrieval": retrieval,
        "num_layers": len(retrieval),
        "num_kv_heads": kv_heads,
        "echo": [[round(x, 5) for x in row] for row in echo.tolist()],
        "induction": [[round(x, 5) for x in row] for row in induction.tolist()],
        "retrieval_query_heads": chosen.tolist(),
        "probe": {
            "len": args.probe_len,
            "repeats": args.repeats,
            "seeds": args.seeds,
            "induction_fraction": args.induction_fraction,
            "echo_fraction": args.echo_fraction,
        },
    }
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    if args.json:
        print(json.dumps(data))
        return 0
    t = Table(
        title=f"RazorAttention probe on {model_dir} ({args.seeds} x {args.repeats} copies of "
        f"{args.probe_len} random tokens)"
    )
    for col in ("layer", "head", "KV head", "echo", "induction", "retrieval"):
        t.add_column(col, justify="right")
    group = echo.shape[1] // kv_heads
    for layer in range(echo.shape[0]):
        for h in range(echo.shape[1]):
            t.add_row(
                str(layer),
                str(h),
                str(h // group),
                f"{echo[layer, h]:.3f}",
                f"{induction[layer, h]:.3f}",
                "yes" if chosen[layer, h] else "",
            )
    console.print(t)
    n_kv = sum(map(sum, retrieval))
    console.print(f"{n_kv} of {len(retrieval) * kv_heads} KV heads keep full attention; head map written to {args.out}")
    return 0
