"""Hydragen's log-sum-exp merge: FlashInfer's ``cascade.merge_state`` against the Triton merge
kernel, correctness and time (one stage of ``benchmarks/gpu/check.py``).

Per shape (tokens, heads, head_dim, tree levels): random suffix and prefix partials (float32
outputs, natural-log lse; every token in 1 to ``levels`` prefix groups), merged three ways: the
PyTorch reference (``hydragen.reference.merge`` level by level), the Triton ``_merge_kernel``
and ``hydragen.flashinfer.merge_partials``; both kernels are checked against the reference,
then timed (CUDA events, median of 50 after 10 warm-up runs). Output in fp16 and bf16.

FlashInfer runs only where ``vllm_graft.plugins._flashinfer.unavailable`` allows (installed at
vLLM's pin, CUDA SM80-121); otherwise its column says why and the row checks Triton alone.
Without a GPU (``--smoke``: CPU, ``TRITON_INTERPRET=1``) one small shape is checked, nothing
timed. Exit status 1 if any kernel misses the reference.
"""
from __future__ import annotations

import argparse
import os
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SHAPES = [(512, 32, 128, 1), (2048, 32, 128, 2), (4096, 32, 128, 3), (8192, 8, 128, 2)]
SMOKE_SHAPES = [(12, 4, 64, 2)]
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2}  # max error / max |reference|: output-dtype rounding


def _source_tree() -> None:
    """Import ``vllm_graft`` from this checkout when it is not installed (as run.py does)."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    import run

    run._source_tree()


def case(t: int, h: int, d: int, levels: int, dtype, device, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    parts = (torch.randint(1, levels + 1, (t,), generator=g) if levels else torch.zeros(t, dtype=torch.long))
    nr = max(int(parts.sum()), 1)
    rows = torch.randperm(nr, generator=g)[: int(parts.sum())]  # each row belongs to one token
    start = torch.zeros(t + 1, dtype=torch.long)
    start[1:] = parts.cumsum(0)

    def to(x, dt=None):
        return x.to(device=device, dtype=dt or x.dtype)

    o_s, o_p = torch.randn(t, h, d, generator=g), torch.randn(nr, h, d, generator=g)
    lse_s, lse_p = torch.randn(t, h, generator=g) * 4, torch.randn(nr, h, generator=g) * 4
    ix = {"part_start": to(start, torch.int32), "part_rows": to(rows if len(rows) else torch.zeros(1, dtype=torch.long), torch.int32),
          "num_groups": levels}
    plan = types.SimpleNamespace(cache={}, prefixes=lambda bs: types.SimpleNamespace(depth=levels))
    out = torch.empty(t, h, d, dtype=dtype, device=device)
    return to(o_s), to(lse_s), to(o_p), to(lse_p), ix, plan, out, (start, rows)


def reference(o_s, lse_s, o_p, lse_p, host_ix):
    from vllm_graft.plugins.attention.hydragen.reference import merge

    start, rows = host_ix
    o, lse = o_s.clone(), lse_s.clone()
    for tk in range(o.shape[0]):
        for k in range(int(start[tk]), int(start[tk + 1])):
            r = int(rows[k])
            o[tk], lse[tk] = merge(o[tk], lse[tk], o_p[r], lse_p[r])
    return o


def reference_batched(o_s, lse_s, o_p, lse_p, ix, levels):
    """The same merge with whole-batch tensor ops (for the large shapes)."""
    import torch

    from vllm_graft.plugins.attention.hydragen.reference import merge

    start = ix["part_start"][:-1].long()
    count = ix["part_start"][1:].long() - start
    rows = ix["part_rows"].long()
    o, lse = o_s.clone(), lse_s.clone()
    for j in range(levels):
        has = count > j
        r = rows[(start + j).clamp(max=rows.numel() - 1)]
        o2, l2 = merge(o, lse, o_p[r], lse_p[r])
        o = torch.where(has[:, None, None], o2, o)
        lse = torch.where(has[:, None], l2, lse)
    return o


def triton_merge(o_s, lse_s, o_p, lse_p, ix, out):
    import triton

    from vllm_graft.plugins.attention.hydragen.kernel import _merge_kernel

    t, h, d = o_s.shape
    _merge_kernel[(t, h)](o_s, lse_s, o_p, lse_p, ix["part_start"], ix["part_rows"], out,
                          o_s.stride(0), o_s.stride(1), lse_s.stride(0), o_p.stride(0), o_p.stride(1),
                          lse_p.stride(0), out.stride(0), out.stride(1), D=d, BLOCK_D=triton.next_power_of_2(d))
    return out


def time_ms(fn, warmup: int = 10, reps: int = 50) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="markdown table to write")
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, one small shape, nothing timed")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    _source_tree()
    import torch

    from vllm_graft.plugins import _flashinfer
    from vllm_graft.plugins.attention.hydragen.flashinfer import merge_partials

    if not args.smoke and not torch.cuda.is_available():
        print("flashinfer_merge: torch sees no CUDA device (--smoke checks the Triton merge on the host)")
        return 1
    device = torch.device("cpu" if args.smoke else "cuda")
    probe = torch.empty(1, device=device)
    why = _flashinfer.unavailable(probe)
    timed = device.type == "cuda"
    lines = ["| tokens x heads x D, levels | dtype | Triton merge | FlashInfer merge_state | max rel. err Triton / FlashInfer |",
             "|---|---|---|---|---|"]
    bad = 0
    for t, h, d, levels in (SMOKE_SHAPES if args.smoke else SHAPES):
        for dtype in (torch.float16, torch.bfloat16):
            name = str(dtype).split(".")[1]
            o_s, lse_s, o_p, lse_p, ix, plan, out, host_ix = case(t, h, d, levels, dtype, device)
            ref = (reference(o_s, lse_s, o_p, lse_p, host_ix) if t <= 64
                   else reference_batched(o_s, lse_s, o_p, lse_p, ix, levels)).float()
            tri = triton_merge(o_s, lse_s, o_p, lse_p, ix, out).float()
            scale = max(ref.abs().max().item(), 1e-6)
            e_tri = (tri - ref).abs().max().item() / scale
            cells = [f"{time_ms(lambda: triton_merge(o_s, lse_s, o_p, lse_p, ix, out)) * 1e3:.1f} us"
                     if timed else "not timed"]
            errs = [f"{e_tri:.1e}"]
            bad += e_tri > TOL[name]
            if why is None:
                fo = torch.empty_like(out)
                got = merge_partials(o_s, lse_s, o_p, lse_p, ix, plan, 16, fo).float()
                e_fi = (got - ref).abs().max().item() / scale
                bad += e_fi > 2 * TOL[name]  # partials rounded to the output dtype before merging
                errs.append(f"{e_fi:.1e}")
                cells.append(f"{time_ms(lambda: merge_partials(o_s, lse_s, o_p, lse_p, ix, plan, 16, fo)) * 1e3:.1f} us"
                             if timed else "not timed")
            else:
                errs.append("-")
                cells.append("skipped")
            lines.append(f"| {t} x {h} x {d}, {levels} | {name} | {cells[0]} | {cells[1]} | {' / '.join(errs)} |")
    note = (f"FlashInfer: {'used' if why is None else 'skipped: ' + why}. Device: "
            f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'host (Triton interpreted)'}.")
    text = "\n".join(lines) + "\n\n" + note + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
