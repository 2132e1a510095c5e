"""``vllm-graft quant-kernel-bench``: the quant plugins' Triton kernels timed against fp16
``torch.matmul`` at Llama-3-8B linear shapes, batch 1-64, with the memory bandwidth each
achieves (bytes of weights, tables and activations read plus output written, per call) and
its fraction of ``--peak-gbs``.

Needs CUDA for meaningful figures. ``--device cpu`` with ``TRITON_INTERPRET=1`` and
``--shapes tiny`` only checks that the command runs (the interpreter's times mean nothing).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from ..command_line import tool_parser, write_json

#: (name, out, in) of Llama-3-8B's linear layers (q/k/v and gate/up fused as vLLM runs them).
LLAMA8B = (("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 28672, 4096), ("down_proj", 4096, 14336))
TINY = (("tiny", 64, 64),)


def add_command(sub: Any) -> None:
    p = tool_parser(
        sub,
        "quant-kernel-bench",
        "time the quant plugins' Triton kernels against fp16 matmul",
        cmd_bench,
        __doc__,
        slice(1),
    )
    p.add_argument("--batch", default="1,4,16,64", help="rows of x (comma-separated; default 1,4,16,64)")
    p.add_argument("--shapes", choices=("llama8b", "tiny"), default="llama8b")
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--peak-gbs",
        type=float,
        default=3350.0,
        help="the device's peak memory bandwidth in GB/s (default: H100 SXM, 3350)",
    )
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", help="also write the rows to this file")


def _time(fn, iters: int, device: str) -> float:
    """Median seconds per call."""
    import time

    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def run(batches: list[int], shapes, device: str, iters: int, peak_gbs: float) -> list[dict[str, Any]]:
    import torch

    from ...hooks import get_registry

    squeezellm = get_registry().get("quant", "squeezellm").registration
    w4a8 = get_registry().get("quant", "w4a8").registration
    lut_matmul = squeezellm.part("kernel").lut_matmul
    pack_bitplanes = squeezellm.part("reference").pack_bitplanes
    w4a8_matmul = w4a8.part("kernel").w4a8_matmul
    w4a8_quantize = w4a8.part("reference").quantize

    rows = []
    for name, n, k in shapes:
        g = torch.Generator().manual_seed(0)
        w16 = (torch.randn(n, k, generator=g) * 0.02).half()
        cases: dict[str, tuple[Callable[..., Any], int]] = {
            "fp16 matmul": (lambda x, w=w16.to(device): torch.matmul(x, w.T), n * k * 2)
        }
        for bits in (4, 3):
            codes = pack_bitplanes(torch.randint(0, 1 << bits, (n, k), generator=g), bits).to(device)
            lut = torch.randn(n, 1 << bits, generator=g).half().to(device)
            cases[f"squeezellm LUT {bits}-bit"] = (
                lambda x, c=codes, t=lut, b=bits: lut_matmul(x, c, t, b),
                codes.numel() + lut.numel() * 2,
            )
        t = {kk: v.to(device) for kk, v in w4a8_quantize(w16.float(), 128).items()}
        cases["w4a8 GEMM"] = (
            lambda x, t=t: w4a8_matmul(x, t, 128),
            sum(v.numel() * v.element_size() for v in t.values()),
        )
        for m in batches:
            x = torch.randn(m, k, generator=g).half().to(device)
            base = None
            for label, (fn, weight_bytes) in cases.items():
                sec = _time(lambda: fn(x), iters, device)
                moved = weight_bytes + x.numel() * 2 + m * n * 2
                gbs = moved / sec / 1e9
                base = base or sec
                rows.append(
                    {
                        "layer": name,
                        "out": n,
                        "in": k,
                        "batch": m,
                        "kernel": label,
                        "us": round(sec * 1e6, 2),
                        "GB/s": round(gbs, 1),
                        "bandwidth_fraction": round(gbs / peak_gbs, 3),
                        "speedup_vs_fp16": round(base / sec, 3),
                    }
                )
    return rows


def cmd_bench(args: argparse.Namespace, console: Any) -> int:
    import torch

    from ...launch.exits import EXIT_INVALID, EXIT_OK

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        console.print(
            "[red]quant-kernel-bench: no CUDA device; the figures need a GPU (for a smoke "
            "run on CPU: TRITON_INTERPRET=1 ... --device cpu --shapes tiny)[/red]"
        )
        return EXIT_INVALID
    batches = [int(b) for b in args.batch.split(",") if b]
    rows = run(batches, LLAMA8B if args.shapes == "llama8b" else TINY, args.device, args.iters, args.peak_gbs)
    for r in rows:
        console.print(
            f"{r['layer']:>13} {r['out']}x{r['in']} M={r['batch']:<3} {r['kernel']:<24} "
            f"{r['us']:>10.2f} us {r['GB/s']:>8.1f} GB/s ({100 * r['bandwidth_fraction']:.1f}% of peak) "
            f"x{r['speedup_vs_fp16']:.2f} vs fp16"
        )
    write_json(args.json, rows)
    return EXIT_OK


__all__ = ["add_command", "run", "LLAMA8B"]
