"""XQuant bases (Tomar et al. 2025, arXiv:2508.10395, its variant for GQA models): the singular
value decomposition of every layer's key and value projections, read from the model's weights
(no forward pass, no calibration text), written to the file that ``kvcompress: {plugin: xquant,
params: {bases: FILE}}`` reads. Run as ``vllm-graft calibrate xquant --model DIR --out FILE``.

The table shows, per layer, the spread of the singular values (largest / smallest) of ``Wk``
and ``Wv``: the factor by which a latent channel's quantisation error can grow on its way back
to K or V relative to another's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

NAME = "xquant"
PLUGIN = "kvcompress:xquant"
HELP = "XQuant: the SVD bases of a model's key and value projections per layer (from its weights)"


def _bases_module():
    from ...hooks import get_registry

    return get_registry().get("kvcompress", "xquant").registration.part("bases")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model folder (default: the bundled graft-tiny-llama)")
    p.add_argument("--out", required=True, metavar="FILE", help="bases file to write (safetensors)")


def run(args: argparse.Namespace, console: Console) -> int:
    from ...launch.engine import models_dir

    xb = _bases_module()
    model_dir = args.model or str(models_dir() / "graft-tiny-llama")
    if not (Path(model_dir).expanduser() / "config.json").is_file():
        console.print(f"[red]{escape(model_dir)} is not a model folder (no config.json)[/]")
        return 2
    t0 = time.time()
    try:
        tensors, meta = xb.compute(model_dir)
    except xb.BasesError as e:
        console.print(f"[red]{escape(str(e))}[/]")
        return 2
    xb.save(args.out, tensors, meta)
    table = Table(title=f"XQuant bases for {model_dir}", box=None)
    for col in ("layer", "Wk singular values (max / min)", "Wv singular values (max / min)"):
        table.add_column(col, justify="right")
    for layer in range(int(meta["num_layers"])):
        ks, vs = tensors["k_s"][layer], tensors["v_s"][layer]
        table.add_row(
            str(layer), f"{float(ks[0]):.3g} / {float(ks[-1]):.3g}", f"{float(vs[0]):.3g} / {float(vs[-1]):.3g}"
        )
    console.print(table)
    console.print(f"{meta['num_layers']} layers, {time.time() - t0:.1f} s; bases written to {escape(args.out)}")
    console.print("use: kvcompress: {plugin: xquant, params: " + json.dumps({"bases": str(args.out)}) + "}")
    return 0
