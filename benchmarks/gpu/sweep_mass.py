"""Tuning sweep for the attention-with-mass decode kernel (plugins/kvcompress/_shared/kernel.py)
on a CUDA GPU: the launcher alone and through ``attend`` (the scored compressors' entry, with its
split of decode and prefill rows), against plain attention (torch SDPA over the same keys and
values gathered contiguous), for each setting of the launcher's knobs. Prints a markdown table.

    python benchmarks/gpu/sweep_mass.py            # B32 ctx2048 H32/8 D128 fp16, block 16
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run  # noqa: E402  (benchmarks/gpu/run.py: the source tree, the cases' builders)


def main() -> int:
    run._source_tree()
    import torch

    from vllm_graft.hooks import split_kv_cache
    from vllm_graft.plugins.kvcompress._shared import kernel
    from vllm_graft.plugins.kvcompress._shared.reference import attend

    ms = run._time_ms
    print(run._environment(False))
    rows = ["| sequences x context | keys/step | warps | programs/SM | launcher ms | attend ms | plain ms "
            "| launcher vs plain |", "|---|---|---|---|---|---|---|---|"]
    for B, ctx in ((32, 2048), (8, 8192)):
        q, kv, batch, layer, _ = run._paged(B, ctx, 32, 8, 128, 16, torch.float16, "cuda", seed=1)
        k_cache, v_cache = split_kv_cache(kv)
        rows_q = batch.query_start_loc[:-1]
        observe = torch.ones(B, dtype=torch.bool, device="cuda")
        plain = run._decode_plain(q, kv, batch, ctx, layer.scale)
        plain_ms = ms(plain)
        want = attend("reference", q, kv, batch, layer, observe)
        for keys, warps, per_sm in itertools.product((64, 128), (4, 8), (2, 4, 8)):
            kernel.KEYS_PER_STEP, kernel.NUM_WARPS, kernel.PROGRAMS_PER_SM = keys, warps, per_sm
            got = attend("triton", q, kv, batch, layer, observe)
            err = max((got[0].float() - want[0].float()).abs().max().item(), (got[1] - want[1]).abs().max().item())
            if err > 2e-3:
                rows.append(f"| {B} x {ctx} | {keys} | {warps} | {per_sm} | WRONG ({err:.1e}) | - | - | - |")
                continue
            launch = ms(lambda: kernel.decode_attention_with_mass(q, k_cache, v_cache, batch.block_table,
                                                                  batch.seq_lens, rows_q, layer.scale))
            through = ms(lambda: attend("triton", q, kv, batch, layer, observe))
            rows.append(f"| {B} x {ctx} | {keys} | {warps} | {per_sm} | {launch:.3f} | {through:.3f} | "
                        f"{plain_ms:.3f} | {plain_ms / launch:.2f}x |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
