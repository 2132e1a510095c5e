"""Per-call CPU timings of the fast paths against the paths they replaced, at decode shapes.

    .venv/bin/python benchmarks/cpu_paths.py [--repeat 50]

Each row times the old path and the new one on the same inputs (median of ``--repeat`` calls
after warm-up, this process's torch threads) and checks that they agree, so a figure in
BENCHMARKS.md can be reproduced on another machine:

* ``w4a8``: the fp64 emulation that rebuilds the int8 weight on every call, against the int8
  weight unpacked once at load and ``torch._int_mm`` (``cpu_weights: int8``); bit-identical.
* ``squeezellm``: the LUT codes unpacked from bit-planes on every call, against indices
  unpacked once (``cpu_weights: indices``); bit-identical.
* paged attention: the per-sequence loop against the batched path (one masked attention
  over blocks gathered at once), for a decode step and for a chunked-prefill step.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from vllm_graft.hooks import AttentionLayer, PagedBatch
from vllm_graft.plugins.attention import _shared as shared
from vllm_graft.plugins.quant.squeezellm import reference as sq
from vllm_graft.plugins.quant.w4a8 import reference as w4


def _ms(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def quant_rows(repeat: int, out: int = 1536, inp: int = 576, tokens: int = 8) -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out, inp, generator=g) * 0.05
    x = torch.randn(tokens, inp, generator=g)
    rows = []
    t = w4.quantize(w, 128)
    t["weight_int8"] = w4.int8_weight(t, 128).to(torch.int8)
    old, new = (lambda: w4.emulate(x, t, 128)), (lambda: w4.int8_matmul(x, t))
    rows.append((f"w4a8 {out}x{inp}, {tokens} tokens", _ms(old, repeat), _ms(new, repeat),
                 torch.equal(old(), new()), _ms(lambda: x @ w.T, repeat)))
    s = sq.quantize(w, None, 4, 0.0, 0.0, 4)
    codes, lut = s["codes"], s["lut"]
    idx = sq.unpack_bitplanes(codes, 4).to(torch.uint8)
    old = lambda: torch.nn.functional.linear(x, sq.dequantize(codes, lut, 4).float())  # noqa: E731
    new = lambda: torch.nn.functional.linear(x, lut.gather(1, idx.long()).float())  # noqa: E731
    rows.append((f"squeezellm 4-bit {out}x{inp}, {tokens} tokens", _ms(old, repeat), _ms(new, repeat),
                 torch.equal(old(), new()), _ms(lambda: x @ w.T, repeat)))
    return rows


def _step(S: int, ctx: int, q_len: int, H: int = 9, Hkv: int = 3, D: int = 64, B: int = 16):
    g = torch.Generator().manual_seed(1)
    width = -(-ctx // B)
    N = S * width + 1
    table = torch.randperm(N, generator=g)[: S * width].view(S, width).int()
    qsl = torch.arange(S + 1, dtype=torch.int32) * q_len
    batch = PagedBatch(qsl, torch.full((S,), ctx, dtype=torch.int32), table)
    kv = torch.randn(N, Hkv, B, 2 * D, generator=g)
    q = torch.randn(S * q_len, H, D, generator=g)
    return q, kv, batch, AttentionLayer(H, Hkv, D, D ** -0.5, B)


def attention_rows(repeat: int) -> list[tuple]:
    rows = []
    for S, ctx, q_len, what in ((8, 256, 1, "decode"), (32, 512, 1, "decode"), (4, 512, 64, "chunked prefill")):
        q, kv, batch, layer = _step(S, ctx, q_len)
        keep = shared.BATCHED_SCORES_MAX
        try:
            shared.BATCHED_SCORES_MAX = 0  # every step sequence by sequence: the old path
            old_out = shared.paged_attention(q, kv, batch, layer)
            old = _ms(lambda: shared.paged_attention(q, kv, batch, layer), repeat)
        finally:
            shared.BATCHED_SCORES_MAX = keep
        new_out = shared.paged_attention(q, kv, batch, layer)
        new = _ms(lambda: shared.paged_attention(q, kv, batch, layer), repeat)
        rows.append((f"paged attention, {what}: {S} seqs x {ctx} ctx, GQA 9/3 x 64", old, new,
                     torch.allclose(old_out, new_out, atol=1e-5, rtol=1e-5), float("nan")))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=50, help="timed calls per path (median reported)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.repeat} calls\n")
    print("| path | old ms | new ms | speed-up | agree | fp32 matmul ms |")
    print("|---|---:|---:|---:|---|---:|")
    for name, old, new, agree, dense in quant_rows(args.repeat) + attention_rows(args.repeat):
        dense_s = "-" if dense != dense else f"{dense:.3f}"
        print(f"| {name} | {old:.3f} | {new:.3f} | {old / new:.1f}x | {'yes' if agree else 'NO'} | {dense_s} |")


if __name__ == "__main__":
    main()
