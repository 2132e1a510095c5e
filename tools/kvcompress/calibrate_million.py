"""MILLION codebook calibration (Wang et al. 2025, arXiv:2504.03661): run the model over
calibration text, collect every layer's keys and values per KV head, k-means each sub-space,
and write the codebook file that ``kvcompress: {plugin: million, params: {codebooks: FILE}}``
reads. Run as ``vllm-graft calibrate million --model DIR --out FILE`` (an entry of the method
table in :mod:`..calibrate`).

Which keys: **post-RoPE**, as vLLM stores them in its KV cache and as the format encodes them
at write time (vLLM's ``do_kv_cache_update`` gets keys with their positions applied), so the
codebooks are fitted to exactly the vectors they will encode. Pre-RoPE codebooks would need
the rotation re-applied to every decoded key at read time, which a lookup table shared by all
positions cannot do. The K/V come from transformers' forward of the model in float32
(its ``DynamicCache`` holds the post-RoPE keys and the values of every layer).

Calibration text: ``--text FILE`` (each file whole, cut into windows of ``--window`` tokens),
else windows of standard-library source (the bundled models' training text), chosen by
``--seed``. Up to ``--tokens`` tokens are collected per layer; every sub-space of every KV head
is clustered on those tokens, independently for keys and values.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

NAME = "million"
PLUGIN = "kvcompress:million"
HELP = "MILLION: k-means codebooks of a model's post-RoPE keys and values per layer, KV head and sub-space"


def _codebooks_module() -> Any:
    from ...hooks import get_registry

    return get_registry().get("kvcompress", "million").registration.part("codebooks")


def _layout_module() -> Any:
    from ...hooks import get_registry

    return get_registry().get("kvcompress", "million").registration.part("layout")


def collect_kv(model: Any, windows: Sequence[Sequence[int]], max_tokens: int):
    """``(keys, values)``, each a list per layer of ``[H_kv, N, D]`` float32 (post-RoPE keys
    as the model's KV cache holds them), over the windows' tokens, at most ``max_tokens``."""
    import torch

    keys: list[list[Any]] = []
    values: list[list[Any]] = []
    taken = 0
    with torch.no_grad():
        for ids in windows:
            if taken >= max_tokens:
                break
            ids = list(ids)[: max_tokens - taken]
            out = model(input_ids=torch.tensor([ids]), use_cache=True)
            layers = out.past_key_values.layers
            if not keys:
                keys, values = [[] for _ in layers], [[] for _ in layers]
            for i, layer in enumerate(layers):
                keys[i].append(layer.keys[0].float())  # [H_kv, T, D]
                values[i].append(layer.values[0].float())
            taken += len(ids)
    if not keys:
        raise ValueError("no calibration tokens")
    return [torch.cat(k, dim=1) for k in keys], [torch.cat(v, dim=1) for v in values]


def fit_codebooks(
    keys: Sequence[Any], values: Sequence[Any], sub_dim: int, bits: int, iters: int, seed: int = 0, on_layer=None
):
    """``(keys [L, H_kv, M, 2**bits, sub_dim], values (same), errors)``: k-means of each layer's,
    KV head's and sub-space's sub-vectors; ``errors[l] = (key, value)`` relative squared error
    of the codes on the calibration tokens."""
    import torch

    kmeans = _codebooks_module().kmeans
    books_k, books_v, errors = [], [], []
    for layer, (k, v) in enumerate(zip(keys, values)):
        H, N, D = k.shape
        M = D // sub_dim
        out = []
        for x in (k, v):
            groups = x.reshape(H, N, M, sub_dim).permute(0, 2, 1, 3).reshape(H * M, N, sub_dim)
            c, err = kmeans(groups, 1 << bits, iters, seed=seed + layer)
            norms = groups.pow(2).sum(dim=(1, 2))
            out.append((c.view(H, M, 1 << bits, sub_dim), float((err * norms).sum() / norms.sum())))
        (ck, ek), (cv, ev) = out
        books_k.append(ck)
        books_v.append(cv)
        errors.append((ek, ev))
        if on_layer is not None:
            on_layer(layer, ek, ev)
    return torch.stack(books_k), torch.stack(books_v), errors


def calibrate(
    model_dir: str,
    out: str,
    windows: Sequence[Sequence[int]],
    *,
    sub_dim: int = 2,
    bits: int = 8,
    iters: int = 10,
    max_tokens: int = 4096,
    seed: int = 0,
    source: str = "",
    on_layer=None,
) -> dict[str, Any]:
    """Calibrate on ``windows`` (token ids) and write the codebook file ``out``; returns what
    it records in the file's ``calibration`` metadata."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    keys, values = collect_kv(model, windows, max_tokens)
    tokens = keys[0].shape[1]
    if tokens < (1 << bits):
        raise ValueError(
            f"{tokens} calibration tokens; k-means into {1 << bits} centroids needs at least that many (--tokens)"
        )
    why = _layout_module().unsupported(keys[0].shape[-1], sub_dim, bits)
    if why:
        raise ValueError(why)
    ck, cv, errors = fit_codebooks(keys, values, sub_dim, bits, iters, seed, on_layer)
    info = {
        "tokens": tokens,
        "windows": len(windows),
        "iterations": iters,
        "seed": seed,
        "source": source,
        "dtype": "float32",
        "relative_sq_error": [[round(ek, 6), round(ev, 6)] for ek, ev in errors],
    }
    _codebooks_module().save(out, ck, cv, {"model": Path(model_dir).name, "keys": "post-rope", "calibration": info})
    return info


def text_windows(
    model_dir: str, files: Sequence[str], window: int, tokens: int, seed: int
) -> tuple[list[list[int]], str]:
    """Token windows to calibrate on and a description of where they came from."""
    from ..workloads import Tokenizer

    tok = Tokenizer.from_model(model_dir)
    if files:
        out = []
        for f in files:
            ids = tok.encode(Path(f).read_text())
            out += [ids[i : i + window] for i in range(0, len(ids), window) if len(ids[i : i + window]) >= 16]
        return out, "text files: " + ", ".join(str(f) for f in files)
    from ..workloads import stdlib_texts

    num = max(1, -(-tokens // window))
    chosen = stdlib_texts(tok, num=num, tokens=window, seed=seed)
    return [
        list(ids) for ids, _ in chosen
    ], f"stdlib source, {num} windows of {window} tokens (seed {seed}): " + ", ".join(s for _, s in chosen)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model folder (default: the bundled graft-tiny-llama)")
    p.add_argument("--out", required=True, metavar="FILE", help="codebook file to write (safetensors)")
    p.add_argument(
        "--text",
        action="append",
        default=[],
        metavar="FILE",
        help="calibration text (repeatable; default: standard-library source windows)",
    )
    p.add_argument("--tokens", type=int, default=4096, metavar="N", help="calibration tokens per layer (default 4096)")
    p.add_argument("--window", type=int, default=512, metavar="N", help="tokens per forward pass (default 512)")
    p.add_argument("--sub-dim", type=int, default=2, choices=[1, 2, 4, 8], help="channels per sub-vector (default 2)")
    p.add_argument("--bits", type=int, default=8, choices=[4, 8], help="bits per code (default 8: 256 centroids)")
    p.add_argument("--iters", type=int, default=10, metavar="N", help="k-means iterations (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of the stdlib windows and the k-means initialisation")


def run(args: argparse.Namespace, console: Console) -> int:
    from ...launch.engine import models_dir

    if args.tokens < 1 or args.window < 16 or args.iters < 1:
        console.print("[red]--tokens must be at least 1, --window at least 16, --iters at least 1[/]")
        return 2
    model_dir = args.model or str(models_dir() / "graft-tiny-llama")
    if not (Path(model_dir) / "config.json").is_file():
        console.print(f"[red]{escape(model_dir)} is not a model folder (no config.json)[/]")
        return 2
    t0 = time.time()
    windows, source = text_windows(model_dir, args.text, args.window, args.tokens, args.seed)
    table = Table(title=f"MILLION codebooks for {model_dir} (sub_dim {args.sub_dim}, {args.bits} bits)", box=None)
    for col in ("layer", "key rel. sq. error", "value rel. sq. error"):
        table.add_column(col, justify="right")

    def row(layer: int, ek: float, ev: float) -> None:
        table.add_row(str(layer), f"{ek:.4f}", f"{ev:.4f}")
        console.print(f"[dim]layer {layer} done ({time.time() - t0:.0f} s)[/]")

    try:
        info = calibrate(
            model_dir,
            args.out,
            windows,
            sub_dim=args.sub_dim,
            bits=args.bits,
            iters=args.iters,
            max_tokens=args.tokens,
            seed=args.seed,
            source=source,
            on_layer=row,
        )
    except ValueError as e:
        console.print(f"[red]{escape(str(e))}[/]")
        return 2
    console.print(table)
    console.print(
        f"{info['tokens']} tokens, {args.iters} k-means iterations, {time.time() - t0:.0f} s; "
        f"codebooks written to {escape(args.out)}"
    )
    console.print(
        "use: kvcompress: {plugin: million, params: "
        + json.dumps({"codebooks": str(args.out), "sub_dim": args.sub_dim, "bits": args.bits})
        + "}"
    )
    return 0
