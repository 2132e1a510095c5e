"""Time every plugin's Triton kernel against its PyTorch reference on a CUDA GPU.

For the day a GPU is lent (the machine has torch and Triton, no vLLM). From the repository root:

    python benchmarks/gpu/run.py --out gpu.md                   # realistic shapes, CUDA
    python benchmarks/gpu/run.py --out gpu.md --update-benchmarks  # and the BENCHMARKS.md section
    python benchmarks/gpu/run.py --smoke                        # CPU, TRITON_INTERPRET=1, tiny shapes

Per case: the same inputs through the reference and the kernel, the outputs compared (the
tolerances of the kernel tests) before anything is timed, then both timed with
``triton.testing.do_bench`` (median of its repeats), and the kernel's achieved bandwidth
(the bytes it must move at least, over its time) against the device's peak, which is measured
first on the device itself (:func:`copy_bandwidth`: a 1 GiB device-to-device copy, bytes read
plus written over the best of ten copies), not looked up by the device's name. A case that
raises is a row that says so; the others still run. ``--smoke`` checks correctness on CPU under
the interpreter and times nothing (it measures a small host copy only to exercise the code).

It imports ``vllm_graft`` from this checkout without installing it (see :func:`_source_tree`):
the plugins need torch, triton, pydantic, pluggy, PyYAML and packaging, nothing else.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
MARK_START, MARK_END = "<!-- gpu-kernels:start -->", "<!-- gpu-kernels:end -->"
COPY_BYTES = 1 << 30  # the peak-bandwidth copy: 1 GiB read, 1 GiB written


def _source_tree() -> None:
    """Make ``vllm_graft.<folder>`` import from this checkout (pyproject's package-dir)."""
    if "vllm_graft" in sys.modules:
        return
    import types

    pkg = types.ModuleType("vllm_graft")
    pkg.__path__ = []
    sys.modules["vllm_graft"] = pkg
    for name in ("hooks", "plugins"):
        spec = importlib.util.spec_from_file_location(
            f"vllm_graft.{name}", ROOT / name / "__init__.py", submodule_search_locations=[str(ROOT / name)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        setattr(pkg, name, module)


@dataclass
class Case:
    kernel: str  # the plugin and its kernel
    shape: str
    dtype: str
    reference: Callable[[], object]
    triton: Callable[[], object]
    bytes_moved: int  # the least the kernel must read and write
    tol: float
    #: what plain vLLM would run instead (attention kernels): torch's scaled_dot_product_attention
    #: over the same keys and values gathered contiguous beforehand, a lower bound of a paged
    #: FlashAttention call on the same bytes (vLLM itself is not on the GPU machine)
    plain: Callable[[], object] | None = None
    #: the reference's attention output from its return value, where plain computes the same
    #: attention (checked before timing: a wrongly gathered plain would time the wrong thing)
    same_as_plain: Callable[[object], object] | None = None


def _close(a, b, tol: float) -> float:
    import torch

    if isinstance(a, (tuple, list)):
        return max(_close(x, y, tol) for x, y in zip(a, b))
    if a.dtype in (torch.int32, torch.int64, torch.uint8):
        return float((a.long() != b.long()).any())
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


# ------------------------------------------------------------------------------ cases
def _contiguous(kv, batch, ctx: int):
    """The keys and values of a decode batch's paged cache (the blocked layout, split by the
    contract's own :func:`split_kv_cache`) gathered into [B, Hkv, ctx, D] each, outside the
    timed call."""
    from vllm_graft.hooks import split_kv_cache

    out = []
    for cache in split_kv_cache(kv):  # [blocks, Hkv, bs, D]
        g = cache[batch.block_table.long()]  # [B, nblk, Hkv, bs, D]
        B, nblk, Hkv, bs, D = g.shape
        out.append(g.permute(0, 2, 1, 3, 4).reshape(B, Hkv, nblk * bs, D)[:, :, :ctx].contiguous())
    return out[0], out[1]


def _sdpa(q, k, v, scale: float, mask=None):
    """Plain attention: q [B, H, Lq, D] over k, v [B, Hkv, Lk, D] (grouped heads), torch's own
    dispatch (FlashAttention-2 or memory-efficient on a GPU)."""
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def _paged(B, ctx, H, Hkv, D, bs, dtype, device, shared_prefix=0, seed=0):
    """A decode batch: B sequences of ``ctx`` tokens (the first ``shared_prefix`` in blocks
    shared by all), one query each, scattered block ids."""
    import torch

    from vllm_graft.hooks import AttentionLayer, PagedBatch

    g = torch.Generator().manual_seed(seed)
    pre, own = shared_prefix // bs, -(-(ctx - shared_prefix) // bs)
    n_blocks = pre + B * own + 1
    perm = torch.randperm(n_blocks, generator=g)
    table = torch.stack([torch.cat([perm[:pre], perm[pre + i * own: pre + (i + 1) * own]]) for i in range(B)])
    batch = PagedBatch(torch.arange(B + 1, dtype=torch.int32, device=device),
                       torch.full((B,), ctx, dtype=torch.int32, device=device), table.to(torch.int32).to(device),
                       max_query_len=1)  # as vLLM's builders say of a decode-only step
    kv = torch.randn(n_blocks, Hkv, bs, 2 * D, generator=g).to(dtype).to(device)
    q = torch.randn(B, H, D, generator=g).to(dtype).to(device)
    return q, kv, batch, AttentionLayer(H, Hkv, D, D ** -0.5, bs, index=0), n_blocks


def _decode_plain(q, kv, batch, ctx: int, scale: float) -> Callable[[], object]:
    k, v = _contiguous(kv, batch, ctx)
    q4 = q[:, :, None, :]  # [B, H, 1, D]
    return lambda: _sdpa(q4, k, v, scale)


def cases(smoke: bool, device: str) -> list[Case]:
    import torch

    dt = torch.float16
    elt = 2
    # decode: 32 sequences x 2K tokens, Llama-3-8B attention (32 heads, 8 KV heads, D 128)
    B, ctx, H, Hkv, D, bs = (3, 80, 4, 2, 64, 16) if smoke else (32, 2048, 32, 8, 128, 16)
    out: list[Case] = []

    from vllm_graft.plugins.attention.hydragen import HydragenParams
    from vllm_graft.plugins.attention.hydragen.reference import Hydragen

    pre = (ctx // 2) // bs * bs
    q, kv, batch, layer, nb = _paged(B, ctx, H, Hkv, D, bs, dt, device, shared_prefix=pre)
    ref_m, tri_m = Hydragen(HydragenParams()), Hydragen(HydragenParams(kernel="triton"))
    plan = tri_m.plan(batch)
    out.append(Case("hydragen (prefix+suffix+merge)", f"B{B} ctx{ctx} shared{pre} H{H}/{Hkv} D{D}", "fp16",
                    lambda: ref_m.forward(q, kv, batch, layer, ref_m.plan(batch)),
                    lambda: tri_m.forward(q, kv, batch, layer, plan),
                    nb * Hkv * bs * 2 * D * elt + 2 * q.numel() * elt, 2e-3,
                    plain=_decode_plain(q, kv, batch, ctx, layer.scale), same_as_plain=lambda out: out))

    from vllm_graft.plugins.attention.squeezed import SqueezedParams
    from vllm_graft.plugins.attention.squeezed.reference import Squeezed

    q2, kv2, batch2, layer2, nb2 = _paged(B, ctx, H, Hkv, D, bs, dt, device, seed=1)
    kw = dict(budget=0.125, chunk=16, sink_tokens=16, recent_tokens=16)
    sq_ref, sq_tri = Squeezed(SqueezedParams(**kw)), Squeezed(SqueezedParams(kernel="triton", **kw))
    out.append(Case("squeezed (chunk scores + sparse decode, K=1/8)", f"B{B} ctx{ctx} H{H}/{Hkv} D{D}", "fp16",
                    lambda: sq_ref.forward(q2, kv2, batch2, layer2),
                    lambda: sq_tri.forward(q2, kv2, batch2, layer2),
                    nb2 * Hkv * bs * D * elt + nb2 * Hkv * bs * 2 * D * elt // 8, 2e-3,
                    plain=_decode_plain(q2, kv2, batch2, ctx, layer2.scale)))

    from vllm_graft.plugins.kvcompress._shared.reference import attend

    observe = torch.ones(B, dtype=torch.bool, device=device)
    out.append(Case("h2o/snapkv attention with block mass", f"B{B} ctx{ctx} H{H}/{Hkv} D{D}", "fp16",
                    lambda: attend("reference", q2, kv2, batch2, layer2, observe),
                    lambda: attend("triton", q2, kv2, batch2, layer2, observe),
                    nb2 * Hkv * bs * 2 * D * elt, 2e-3,
                    plain=_decode_plain(q2, kv2, batch2, ctx, layer2.scale), same_as_plain=lambda out: out[0]))

    from vllm_graft.plugins.kvcompress.kv4.kernel import paged_attention_kv4_triton
    from vllm_graft.plugins.kvcompress.kv4.reference import bytes_per_token, paged_attention_kv4, write

    G = 32
    cache = torch.zeros(nb2, Hkv, bs, bytes_per_token(D, bs, G), dtype=torch.uint8, device=device)
    for i in range(B):
        slots = batch2.block_table[i, torch.arange(ctx, device=device) // bs].long() * bs \
            + torch.arange(ctx, device=device) % bs
        write(torch.randn(ctx, Hkv, D, device=device).to(dt), torch.randn(ctx, Hkv, D, device=device).to(dt),
              cache, slots, G)
    out.append(Case("kv4 paged attention (4-bit KV)", f"B{B} ctx{ctx} H{H}/{Hkv} D{D}", "fp16",
                    lambda: paged_attention_kv4(q2, cache, batch2, layer2, G)[0],
                    lambda: paged_attention_kv4_triton(q2, cache, batch2, layer2, G),
                    cache.numel(), 2e-3,
                    plain=_decode_plain(q2, kv2, batch2, ctx, layer2.scale)))  # fp16 KV of the same shape

    out += _routing_and_weight_cases(smoke, device, dt)
    # one verify step of a 28-node draft tree (breadth 4,2,1,1) over one sequence's paged context,
    # and a larger one: 64 nodes (breadth 16,1,1,1: two row tiles of the kernel) over 16K tokens
    out.append(_tree_case(80 if smoke else 4096, (4, 2, 1, 1), H, Hkv, D, bs, dt, device))
    out.append(_tree_case(96 if smoke else 16384, (16, 1, 1, 1), H, Hkv, D, bs, dt, device))
    return out


def _routing_and_weight_cases(smoke: bool, device: str, dt) -> list[Case]:
    """MoE routing, the quantised GEMMs and decoders, and token recycling's update: no paged KV."""
    import torch

    out: list[Case] = []
    from vllm_graft.plugins.moe.dynamic_topk.kernel import dynamic_topk_triton
    from vllm_graft.plugins.moe.dynamic_topk.reference import dynamic_topk

    T, E, k = (64, 8, 2) if smoke else (8192, 64, 6)
    logits = torch.randn(T, E, device=device)
    out.append(Case("dynamic-topk routing", f"T{T} E{E} top{k}", "fp32",
                    lambda: dynamic_topk(logits, k, True, threshold=0.9)[:2],
                    lambda: tuple(x.long() if x.dtype == torch.int32 else x
                                  for x in dynamic_topk_triton(logits, k, True, threshold=0.9)[:2]),
                    logits.numel() * 4 + T * k * 8, 1e-5))

    N, K, M = (64, 128, 4) if smoke else (4096, 4096, 16)  # a Llama-7B projection, decode batch 16
    from vllm_graft.plugins.quant.w4a8.kernel import w4a8_matmul
    from vllm_graft.plugins.quant.w4a8.reference import emulate, quantize

    w = torch.randn(N, K, device=device) * 0.02
    t = quantize(w, 128)
    x = torch.randn(M, K, device=device)
    out.append(Case("w4a8 GEMM", f"M{M} N{N} K{K} g128", "fp32 act",
                    lambda: emulate(x, t, 128), lambda: w4a8_matmul(x, t, 128),
                    N * K // 2 + M * K * 4 + M * N * 4, 1e-3))

    from vllm_graft.plugins.quant.squeezellm.kernel import lut_matmul
    from vllm_graft.plugins.quant.squeezellm.reference import dequantize, pack_bitplanes

    bits = 4
    codes = pack_bitplanes(torch.randint(0, 2 ** bits, (N, K), device=device), bits)
    lut = (torch.randn(N, 2 ** bits, device=device) * 0.02).to(dt)
    xh = torch.randn(M, K, device=device).to(dt)
    out.append(Case("squeezellm LUT GEMV (4-bit)", f"M{M} N{N} K{K}", "fp16",
                    lambda: xh @ dequantize(codes, lut, bits).T, lambda: lut_matmul(xh, codes, lut, bits),
                    codes.numel() + lut.numel() * 2 + M * (K + N) * 2, 5e-2))

    from vllm_graft.plugins.quant.dfloat11 import kernel as df_kernel
    from vllm_graft.plugins.quant.dfloat11 import reference as df_ref

    enc = df_ref.encode((torch.randn(N, K) * 0.02).to(torch.bfloat16))
    sym, ln = df_ref.decode_table(enc["code_lengths"], 12)
    pos = enc["chunk_offsets"].to(torch.int64)
    args = (enc["exponents"].to(device), pos.to(device), torch.zeros_like(pos).to(device), sym.to(device),
            ln.to(device), int(enc["header"][3]), 12)
    out.append(Case("dfloat11 exponent decode (Huffman)", f"{N}x{K} bf16", "bf16",
                    lambda: df_ref.decode_exponents(*args), lambda: df_kernel.decode_exponents(*args),
                    enc["exponents"].numel() + N * K, 0.0))

    from vllm_graft.plugins.speculative.token_recycling.kernel import recycle_update
    from vllm_graft.plugins.speculative.token_recycling.reference import topk_update_reference

    R, V, kk = (4, 512, 4) if smoke else (64, 32000, 8)
    lg = torch.randn(R, V, device=device)
    toks = torch.randint(0, V, (R,), device=device)
    m0 = torch.zeros(V, kk, dtype=torch.int64, device=device)
    out.append(Case("token-recycling adjacency update", f"R{R} V{V} k{kk}", "fp32",
                    lambda: topk_update_reference(lg, toks, m0.clone()),
                    lambda: recycle_update(lg, toks, m0.clone()),
                    lg.numel() * 4 + R * kk * 8, 0.0))

    return out


def _tree_case(tctx: int, breadth: tuple[int, ...], H, Hkv, D, bs, dt, device) -> Case:
    """Tree verification attention for one sequence: a draft tree of the given breadth per level
    over ``tctx`` tokens of paged context; plain is a causal chain of as many tokens."""
    import itertools

    import torch

    from vllm_graft.plugins.speculative._tree import DraftTree, tree_attention
    from vllm_graft.plugins.speculative._tree.kernel import pack_ancestor_bits, tree_attention_triton

    elt = torch.tensor([], dtype=dt).element_size()
    chains = [[10 * level + c for level, c in enumerate(path)] for path in itertools.product(*map(range, breadth))]
    tree = DraftTree.from_chains(chains)
    N = len(tree.tokens)
    g = torch.Generator().manual_seed(3)
    nbt = -(-tctx // bs)
    kc = torch.randn(nbt + 1, bs, Hkv, D, generator=g).to(dt).to(device)
    vc = torch.randn(nbt + 1, bs, Hkv, D, generator=g).to(dt).to(device)
    bt = torch.randperm(nbt + 1, generator=g)[:nbt].to(torch.int32).to(device)
    tq = torch.randn(N, H, D, generator=g).to(dt).to(device)
    tk = torch.randn(N, Hkv, D, generator=g).to(dt).to(device)
    tv = torch.randn(N, Hkv, D, generator=g).to(dt).to(device)
    par = tree.parents.to(device)
    # the bitmask as the adapter passes it: built once per verify step, shared by every layer
    bits = pack_ancestor_bits(tree.ancestor_mask()).to(device)
    # plain: a chain of the same N tokens verified with a causal mask over the same context
    ck = torch.cat([kc[bt.long()].reshape(-1, Hkv, D)[:tctx], tk]).transpose(0, 1)[None].contiguous()
    cv = torch.cat([vc[bt.long()].reshape(-1, Hkv, D)[:tctx], tv]).transpose(0, 1)[None].contiguous()
    causal = torch.ones(N, tctx + N, dtype=torch.bool, device=device).tril(tctx)
    tq4 = tq.transpose(0, 1)[None]
    return Case("tree verification attention (paged context + ancestor mask)",
                f"ctx{tctx} nodes{N} H{H}/{Hkv} D{D}", "fp16",
                lambda: tree_attention(tq, kc, vc, bt, tctx, tk, tv, par, D ** -0.5),
                lambda: tree_attention_triton(tq, kc, vc, bt, tctx, tk, tv, par, D ** -0.5, ancestor_bits=bits),
                2 * tctx * Hkv * D * elt + 2 * N * (H + 2 * Hkv) * D * elt, 2e-3,
                plain=lambda: _sdpa(tq4, ck, cv, D ** -0.5, causal))


# ------------------------------------------------------------------------------ running
def _time_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100)


def copy_bandwidth(device: str, nbytes: int = COPY_BYTES, repeats: int = 10) -> float:
    """The device's memory bandwidth in GB/s, measured: ``nbytes`` copied device to device
    (``dst.copy_(src)``), bytes read plus written over the fastest of ``repeats`` copies after
    three warm-up copies; CUDA events time each copy on a GPU, the wall clock on the host."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    cuda = src.device.type == "cuda"
    for _ in range(3):
        dst.copy_(src)
    if cuda:
        torch.cuda.synchronize()
    seconds = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds.append(time.perf_counter() - t0)
    assert bool(dst[-1] == 1)
    del src, dst
    if cuda:
        torch.cuda.empty_cache()
    return 2 * (nbytes // 4 * 4) / min(seconds) / 1e9


def _environment(smoke: bool) -> str:
    import torch
    import triton

    if smoke:
        name = "CPU (TRITON_INTERPRET=1: correctness only, not timed)"
    else:
        props = torch.cuda.get_device_properties(0)
        name = f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2 ** 30:.0f} GiB)"
    cuda = f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""
    return (f"Device: {name}; torch {torch.__version__}{cuda}, "
            f"triton {triton.__version__}; `python benchmarks/gpu/run.py{' --smoke' if smoke else ''}`, "
            f"{time.strftime('%Y-%m-%d')}.")


def run(smoke: bool, peak: float | None) -> tuple[str, list[dict]]:
    device = "cpu" if smoke else "cuda"
    head = _environment(smoke)
    if peak is not None:
        peak_note = f"Peak bandwidth: {peak:.0f} GB/s (given with --peak-gbps, not measured)."
    elif smoke:  # exercises the measurement; a host copy says nothing of a GPU's peak
        host = copy_bandwidth("cpu", 64 << 20, repeats=3)
        peak_note = f"Peak bandwidth: not measured (smoke; a 64 MiB host copy moved {host:.1f} GB/s)."
    else:
        peak = copy_bandwidth(device)
        peak_note = (f"Peak bandwidth: {peak:.0f} GB/s (measured: a {COPY_BYTES / 2 ** 30:.0f} GiB "
                     "device-to-device copy, bytes read + written, fastest of 10); \"% of peak\" is "
                     "against it.")
    print(head, peak_note, flush=True)
    rows = []
    try:
        built = cases(smoke, device)
    except Exception as e:  # noqa: BLE001 - reported in the table, the exit status says it
        built = []
        rows.append({"kernel": "(building the cases)", "shape": "-", "dtype": "-", "ok": False,
                     "error": f"{type(e).__name__}: {e}"})
    for c in built:
        print(f"  {c.kernel} ...", flush=True)
        row = {"kernel": c.kernel, "shape": c.shape, "dtype": c.dtype}
        try:
            err = _close(c.reference(), c.triton(), c.tol)
            ok = err <= c.tol
            timed = ok and not smoke  # the interpreter's times say nothing about a GPU
            ref_ms = _time_ms(c.reference) if timed else float("nan")
            tri_ms = _time_ms(c.triton) if timed else float("nan")
            if c.plain is not None:
                got = c.plain()  # runs in --smoke too
                if c.same_as_plain is not None:
                    plain_err = _close(c.same_as_plain(c.reference()), got[:, :, 0], c.tol)
                    if plain_err > c.tol:
                        raise AssertionError(f"plain attention differs from the reference by {plain_err:.1e}")
            plain_ms = _time_ms(c.plain) if timed and c.plain is not None else float("nan")
        except Exception as e:  # noqa: BLE001 - one kernel's failure is its row; the rest still run
            rows.append({**row, "ok": False, "error": f"{type(e).__name__}: {e}"})
            continue
        gbps = c.bytes_moved / tri_ms / 1e6 if timed and tri_ms > 0 else float("nan")
        rows.append({**row, "max_err": err, "ok": ok, "ref_ms": ref_ms, "triton_ms": tri_ms,
                     "speedup": ref_ms / tri_ms if timed else float("nan"), "plain_ms": plain_ms,
                     "vs_plain": plain_ms / tri_ms if timed else float("nan"),
                     "gbps": gbps, "peak_pct": 100 * gbps / peak if peak and timed else None})
    table = ["| kernel | shape | dtype | matches reference (max abs err) | reference ms | Triton ms "
             "| speed-up | GB/s | % of peak | plain attention ms | Triton vs plain |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def fmt(v: float, spec: str, unit: str = "") -> str:
        return "-" if v != v else f"{v:{spec}}{unit}"  # NaN: not timed

    for r in rows:
        if "error" in r:
            msg = " ".join(r["error"].split())[:200].replace("|", "/")
            table.append(f"| {r['kernel']} | {r['shape']} | {r['dtype']} | ERROR: {msg} | - | - | - | - | - | - | - |")
            continue
        pct = f"{r['peak_pct']:.0f}%" if r["peak_pct"] is not None else "-"
        table.append(f"| {r['kernel']} | {r['shape']} | {r['dtype']} | {'yes' if r['ok'] else 'NO'} "
                     f"({r['max_err']:.1e}) | {fmt(r['ref_ms'], '.3f')} | {fmt(r['triton_ms'], '.3f')} | "
                     f"{fmt(r['speedup'], '.1f', 'x')} | {fmt(r['gbps'], '.0f')} | {pct} | "
                     f"{fmt(r['plain_ms'], '.3f')} | {fmt(r['vs_plain'], '.2f', 'x')} |")
    note = ("\"plain attention\": what plain vLLM runs instead, approximated by torch's "
            "scaled_dot_product_attention over the same keys and values gathered contiguous before "
            "timing (vLLM is not on this machine; a lower bound of its paged FlashAttention); the tree "
            "rows' plain is a causal chain of as many tokens. \"Triton vs plain\" above 1x is faster "
            "than plain.")
    return f"{head} {peak_note}\n\n" + "\n".join(table) + "\n\n" + note + "\n", rows


def update_benchmarks(text: str, path: Path = ROOT / "BENCHMARKS.md") -> None:
    body = path.read_text()
    if MARK_START not in body or MARK_END not in body:
        raise SystemExit(f"{path} has no {MARK_START} ... {MARK_END} section")
    before, rest = body.split(MARK_START, 1)
    _, after = rest.split(MARK_END, 1)
    path.write_text(f"{before}{MARK_START}\n{text}{MARK_END}{after}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes: correctness only")
    ap.add_argument("--out", help="write the markdown table here")
    ap.add_argument("--update-benchmarks", action="store_true", help="replace the GPU section of BENCHMARKS.md")
    ap.add_argument("--peak-gbps", type=float, help="use this peak memory bandwidth (GB/s) instead of measuring it")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    _source_tree()
    import torch

    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke for the CPU correctness check")
    text, rows = run(args.smoke, args.peak_gbps)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.update_benchmarks:
        update_benchmarks(text)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
