"""Tuning sweep for the tree-verification attention kernel (plugins/speculative/_tree/kernel.py)
on a CUDA GPU: the kernel for each setting of its knobs (rows per program, keys per step, warps,
least keys per split), against plain attention of a causal chain of as many tokens (torch SDPA
over the same keys and values gathered contiguous), on the two tree cases of run.py. Every
setting's output is checked against the reference first. Prints a markdown table.

    python benchmarks/gpu/sweep_tree.py            # H 32/8 D 128 fp16, block 16
    python benchmarks/gpu/sweep_tree.py --smoke    # CPU, TRITON_INTERPRET=1, tiny shapes, one setting
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run  # noqa: E402  (benchmarks/gpu/run.py: the source tree, the cases' builders)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes: correctness only")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    run._source_tree()
    import torch

    from vllm_graft.plugins.speculative._tree import kernel

    device = "cpu" if args.smoke else "cuda"
    H, Hkv, D, bs = (4, 2, 64, 16) if args.smoke else (32, 8, 128, 16)
    shapes = ((80, (4, 2, 1, 1)), (96, (16, 1, 1, 1))) if args.smoke else ((4096, (4, 2, 1, 1)), (16384, (16, 1, 1, 1)))
    grid = [(128, 32, 8, 256)] if args.smoke else list(
        itertools.product((64, 128), (32, 64), (4, 8), (128, 256, 512)))
    print(run._environment(args.smoke))
    rows = ["| case | rows/program | keys/step | warps | least keys/split | splits | Triton ms | plain ms | vs plain |",
            "|---|---|---|---|---|---|---|---|---|"]
    ok = True
    for ctx, breadth in shapes:
        case = run._tree_case(ctx, breadth, H, Hkv, D, bs, torch.float16, device)
        want = case.reference()
        plain_ms = float("nan") if args.smoke else run._time_ms(case.plain)
        for max_rows, keys, warps, min_keys in grid:
            kernel.MAX_ROWS, kernel.KEYS_PER_STEP, kernel.NUM_WARPS, kernel.MIN_KEYS_PER_SPLIT = (
                max_rows, keys, warps, min_keys)
            nodes = sum(math.prod(breadth[: i + 1]) for i in range(len(breadth)))  # the tree's size
            plan = kernel.launch_plan(torch.device(device), nodes, H, Hkv, D, bs, -(-ctx // bs))
            err = (case.triton().float() - want.float()).abs().max().item()
            if err > case.tol:
                ok = False
                rows.append(f"| {case.shape} | {max_rows} | {keys} | {warps} | {min_keys} | - | WRONG ({err:.1e}) "
                            "| - | - |")
                continue
            ms = float("nan") if args.smoke else run._time_ms(case.triton)
            rows.append(f"| {case.shape} | {max_rows} | {keys} | {warps} | {min_keys} | {plan[3]} x {plan[4] * bs} keys | {ms:.3f} | "
                        f"{plain_ms:.3f} | {plain_ms / ms:.2f}x |")
    print("\n".join(rows))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
