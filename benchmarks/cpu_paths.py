"""Per-call CPU timings of the fast paths against the paths they replaced, at decode shapes.

    .venv/bin/python benchmarks/cpu_paths.py [--repeat 50]

Each row times the old path and the new one on the same inputs (median of ``--repeat`` calls
after warm-up, this process's torch threads) and checks that they agree, so a figure in
BENCHMARKS.md can be reproduced on another machine. The last column is what the plain arm runs
instead (an fp32 matmul for the quant rows, vLLM's C++ attention for hydragen):

* ``w4a8``: the fp64 emulation that rebuilds the int8 weight on every call, against the int8
  weight unpacked once at load and ``torch._int_mm`` (``cpu_weights: int8``); bit-identical.
* ``squeezellm``: the LUT codes unpacked from bit-planes on every call, against indices
  unpacked once (``cpu_weights: indices``); bit-identical.
* paged attention: the per-sequence loop against the batched path (one masked attention
  over blocks gathered at once), for a decode step and for a chunked-prefill step.
* ``squeezellm`` layer call: the torch gather against the C++ path (``cpu_dequant: cpp``,
  decode-sized: fused LUT lookups and multiply-adds); to fp32 rounding.
* ``dfloat11`` layer call: the torch decoder against the C++ one (``cpu_decoder: cpp``), each
  decoding the weight then multiplying in bf16; bit-identical. Host: the bf16 matmul alone.
* ``squeezed`` at K = 1/8 on a 4K context: the per-sequence path against the batched one
  (centroids kept between steps), beside vLLM's C++ full attention on the same step.
* hydragen: the per-sequence reference against the batched CPU path, for a decode step of
  sequences sharing a 1K-token prefix (one group, and four groups of 8), beside vLLM's own
  C++ paged attention on the same step (the plain arm's kernel; the cache written in its
  layout by its own op), the column "host kernel ms".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder, also when loaded by a test
from _timing import median_ms  # noqa: E402

from vllm_graft.hooks import AttentionLayer, PagedBatch
from vllm_graft.plugins.attention import _shared as shared
from vllm_graft.plugins.attention.hydragen import HydragenParams
from vllm_graft.plugins.attention.hydragen import reference as hydragen
from vllm_graft.plugins.attention.squeezed import SqueezedParams
from vllm_graft.plugins.attention.squeezed import reference as squeezed
from vllm_graft.plugins.quant.dfloat11 import DFloat11Params
from vllm_graft.plugins.quant.dfloat11 import reference as df11
from vllm_graft.plugins.quant.squeezellm import SqueezeLLMParams
from vllm_graft.plugins.quant.squeezellm import reference as sq
from vllm_graft.plugins.quant.w4a8 import reference as w4


def _ms(fn: Callable[[], object], repeat: int) -> float:
    return median_ms(fn, repeat, warmup=1)


def _row(what: str, old: Callable[[], object], new: Callable[[], object], agree: bool,
         host: Callable[[], object] | None, repeat: int, old_repeat: int | None = None) -> tuple:
    """A table row: ``what``, the old and the new path's median ms (the old one's over ``old_repeat``
    calls where it is slow), whether they ``agree``, and the host kernel's ms (nan where none)."""
    return (what, _ms(old, old_repeat or repeat), _ms(new, repeat), agree,
            float("nan") if host is None else _ms(host, repeat))


def quant_rows(repeat: int, out: int = 1536, inp: int = 576, tokens: int = 8) -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out, inp, generator=g) * 0.05
    x = torch.randn(tokens, inp, generator=g)
    rows = []
    t = w4.quantize(w, 128)
    t["weight_int8"] = w4.int8_weight_for_int_mm(t, 128)
    old, new = (lambda: w4.emulate(x, t, 128)), (lambda: w4.int8_matmul(x, t))
    rows.append(_row(f"w4a8 {out}x{inp}, {tokens} tokens", old, new, torch.equal(old(), new()), lambda: x @ w.T,
                     repeat))
    s = sq.quantize(w, None, 4, 0.0, 0.0, 4)
    codes, lut = s["codes"], s["lut"]
    idx = sq.unpack_bitplanes(codes, 4).to(torch.uint8)
    old = lambda: torch.nn.functional.linear(x, sq.dequantize(codes, lut, 4).float())  # noqa: E731
    new = lambda: torch.nn.functional.linear(x, lut.gather(1, idx.long()).float())  # noqa: E731
    rows.append(_row(f"squeezellm 4-bit {out}x{inp}, {tokens} tokens", old, new, torch.equal(old(), new()),
                     lambda: x @ w.T, repeat))
    # the whole layer call (sparse part included): the torch gather against the C++ path
    params = {"bits": 4, "kmeans_iters": 4}
    fast, slow = (
        sq.SqueezeLLM(SqueezeLLMParams(**params)),
        sq.SqueezeLLM(SqueezeLLMParams(**params, cpu_dequant="torch")),
    )
    t = fast.load({k: [v] for k, v in fast.quantize(w).items()}, [out])
    old, new = (lambda: slow.apply(t, x, None)), (lambda: fast.apply(t, x, None))
    rows.append(_row(f"squeezellm 4-bit layer call {out}x{inp}, {tokens} tokens: torch gather vs C++ (cpu_dequant)",
                     old, new, torch.allclose(old(), new(), rtol=1e-5, atol=1e-6), lambda: x @ w.T, repeat))
    # dfloat11: the torch decoder against the C++ one, each decoding then multiplying in bf16
    wb = w.to(torch.bfloat16)
    fast, slow = df11.DFloat11(DFloat11Params()), df11.DFloat11(DFloat11Params(cpu_decoder="torch"))
    t = fast.load({k: [v] for k, v in fast.quantize(wb).items()}, [out])
    xb = x.to(torch.bfloat16)
    old, new = (lambda: slow.apply(t, xb, None)), (lambda: fast.apply(t, xb, None))
    rows.append(_row(f"dfloat11 layer call {out}x{inp}, {tokens} tokens: torch decoder vs C++ (cpu_decoder); "
                     "host: bf16 matmul", old, new, torch.equal(old(), new()), lambda: xb @ wb.T, repeat,
                     old_repeat=max(3, repeat // 10)))
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
    return q, kv, batch, AttentionLayer(H, Hkv, D, D**-0.5, B)


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
        rows.append(
            (
                f"paged attention, {what}: {S} seqs x {ctx} ctx, GQA 9/3 x 64",
                old,
                new,
                torch.allclose(old_out, new_out, atol=1e-5, rtol=1e-5),
                float("nan"),
            )
        )
    return rows


def _shared_prefix_step(
    S: int, groups: int, prefix_blocks: int, own: int, H: int = 9, Hkv: int = 3, D: int = 64, B: int = 128
):
    """A decode step of ``S`` sequences in ``groups`` equal groups, each group sharing
    ``prefix_blocks`` blocks (prefix caching's same block ids), each sequence ``own`` more tokens."""
    g = torch.Generator().manual_seed(2)
    per, nid, rows = S // groups, groups * prefix_blocks, []
    prefixes = [list(range(k * prefix_blocks, (k + 1) * prefix_blocks)) for k in range(groups)]
    for i in range(S):
        n = -(-own // B)
        rows.append(prefixes[i // per] + list(range(nid, nid + n)))
        nid += n
    width = max(map(len, rows))
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    lens = torch.full((S,), prefix_blocks * B + own, dtype=torch.int32)
    batch = PagedBatch(torch.arange(S + 1, dtype=torch.int32), lens, table)
    kv = torch.randn(nid + 1, Hkv, B, 2 * D, generator=g)
    return torch.randn(S, H, D, generator=g), kv, batch, AttentionLayer(H, Hkv, D, D**-0.5, B)


def _vllm_attention(q: torch.Tensor, kv: torch.Tensor, batch: PagedBatch, layer: AttentionLayer):
    """vLLM's CPU paged attention on this step (None without vLLM): a function computing it."""
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    from vllm_graft.hooks import split_kv_cache

    N, hkv, B, d2 = kv.shape
    isa = _get_attn_isa(q.dtype, B, d2 // 2)
    k, v = split_kv_cache(kv)
    host = torch.zeros_like(kv).view(N, hkv, 2 * B, d2 // 2)
    k_cache, v_cache = host.chunk(2, dim=2)
    flat = lambda t: t.permute(0, 2, 1, 3).reshape(N * B, hkv, -1).contiguous()  # noqa: E731
    ops.cpu_attn_reshape_and_cache(
        flat(k), flat(v), k_cache, v_cache, torch.arange(N * B), isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
    )
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=batch.seq_lens.numel(),
        num_heads=layer.num_heads,
        num_kv_heads=hkv,
        head_dim=layer.head_size,
        seq_lens=batch.seq_lens,
        dtype=q.dtype,
        query_start_loc=batch.query_start_loc,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
    )
    out = torch.empty_like(q)

    def run() -> torch.Tensor:
        ops.cpu_attention_with_kv_cache(
            query=q,
            key_cache=k_cache,
            value_cache=v_cache,
            output=out,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            scale=layer.scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=batch.block_table,
            softcap=0.0,
            scheduler_metadata=meta,
            s_aux=None,
        )
        return out

    return run


def hydragen_rows(repeat: int, cases=((32, 1, 8, 40), (32, 4, 8, 40), (8, 1, 8, 40))) -> list[tuple]:
    rows = []
    for S, groups, prefix_blocks, own in cases:
        q, kv, batch, layer = _shared_prefix_step(S, groups, prefix_blocks, own)
        m = hydragen.Hydragen(HydragenParams())
        plan = m.plan(batch)
        old = lambda: hydragen.hydragen_attention(q, kv, batch, layer, plan)  # noqa: E731
        new = lambda: hydragen.hydragen_attention_batched(q, kv, batch, layer, plan)  # noqa: E731
        host = _vllm_attention(q, kv, batch, layer)
        agree = torch.allclose(old(), new(), atol=1e-5, rtol=1e-5)
        if host is not None:
            agree = agree and torch.allclose(host(), new(), atol=1e-5, rtol=1e-5)
        rows.append(_row(f"hydragen, decode: {S} seqs in {groups} group(s) sharing {prefix_blocks * 128} "
                         f"tokens + {own} own, GQA 9/3 x 64", old, new, agree, host, repeat))
    return rows


def squeezed_rows(repeat: int, cases=((4, 4096),), B: int = 128) -> list[tuple]:
    """squeezed at K = 1/8 (chunk 16, 16 sink and 64 recent tokens), a decode step: the
    per-sequence path against the batched one (its centroids already kept: the steady state),
    beside vLLM's C++ full attention on the same step."""
    rows = []
    for S, ctx in cases:
        q, kv, batch, layer = _step(S, ctx, 1, B=B)
        params = {"budget": 0.125, "chunk": 16, "sink_tokens": 16, "recent_tokens": 64}
        fast = squeezed.Squeezed(SqueezedParams(**params))
        slow = squeezed.Squeezed(SqueezedParams(**params, cpu_path="per-sequence"))
        old = lambda: slow.forward(q, kv, batch, layer)  # noqa: E731
        new = lambda: fast.forward(q, kv, batch, layer)  # noqa: E731
        host = _vllm_attention(q, kv, batch, layer)
        rows.append(_row(f"squeezed K=1/8, decode: {S} seqs x {ctx} ctx, GQA 9/3 x 64 (host: full attention)", old,
                         new, torch.allclose(old(), new(), atol=1e-5, rtol=1e-5), host, repeat,
                         old_repeat=max(3, repeat // 5)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=50, help="timed calls per path (median reported)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.repeat} calls\n")
    print("| path | old ms | new ms | speed-up | agree | host kernel ms |")
    print("|---|---:|---:|---:|---|---:|")
    for name, old, new, agree, dense in (
        quant_rows(args.repeat) + attention_rows(args.repeat) + hydragen_rows(args.repeat) + squeezed_rows(args.repeat)
    ):
        dense_s = "-" if dense != dense else f"{dense:.3f}"
        print(f"| {name} | {old:.3f} | {new:.3f} | {old / new:.1f}x | {'yes' if agree else 'NO'} | {dense_s} |")


if __name__ == "__main__":
    main()
