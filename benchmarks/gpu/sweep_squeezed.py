"""`squeezed`'s decode path on a CUDA GPU (``kernel: triton``): the whole forward, and its three
parts alone (the chunk-scoring kernel, the choice of chunks in PyTorch, the sparse-decode kernel),
against plain attention (torch SDPA over the same keys and values gathered contiguous), at
growing contexts with the budget of ``run.py``'s row (1/8, chunks of 16, 16 sink and 16 recent
tokens). Each output is checked against the reference first. Prints a markdown table.

    python benchmarks/gpu/sweep_squeezed.py      # H32/8 D128 fp16, block 16
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run  # noqa: E402  (benchmarks/gpu/run.py: the source tree, the cases' builders)


def main() -> int:
    run._source_tree()
    import torch

    from vllm_graft.plugins.attention.squeezed import SqueezedParams
    from vllm_graft.plugins.attention.squeezed.kernel import chunk_scores_triton, sparse_decode_triton
    from vllm_graft.plugins.attention.squeezed.reference import Squeezed, batched_choice

    ms = run._time_ms
    print(run._environment(False))
    kw = dict(budget=0.125, chunk=16, sink_tokens=16, recent_tokens=16)
    rows = [
        "| sequences x context | matches reference (max abs err) | forward ms | scores ms | choice ms | sparse ms "
        "| plain ms | forward vs plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for B, ctx in ((32, 2048), (8, 8192), (4, 32768)):
        q, kv, batch, layer, _ = run._paged(B, ctx, 32, 8, 128, 16, torch.float16, "cuda", seed=1)
        ref_m, tri_m = Squeezed(SqueezedParams(**kw)), Squeezed(SqueezedParams(kernel="triton", **kw))
        err = (tri_m.forward(q, kv, batch, layer).float() - ref_m.forward(q, kv, batch, layer).float()).abs().max()
        plain_ms = ms(run._decode_plain(q, kv, batch, ctx, layer.scale))
        whole = ms(lambda: tri_m.forward(q, kv, batch, layer))
        ids, lens = list(range(B)), [ctx] * B
        budgets = [tri_m.budget(ctx)] * B
        n = torch.tensor(lens, device="cuda")
        scores = chunk_scores_triton(q, kv, batch, layer, 16, ids, ids, lens)
        sel = batched_choice(budgets, n, 8, 16, lambda complete: scores)
        width = len(budgets[0].sink) + len(budgets[0].recent) + budgets[0].extra
        out = torch.empty_like(q)
        t_scores = ms(lambda: chunk_scores_triton(q, kv, batch, layer, 16, ids, ids, lens))
        t_choice = ms(lambda: batched_choice(budgets, n, 8, 16, lambda complete: scores))
        t_sparse = ms(lambda: sparse_decode_triton(q, kv, batch, layer, 16, ids, ids, lens, sel, out, width))
        ok = "yes" if err <= 2e-3 else "NO"
        rows.append(
            f"| {B} x {ctx} | {ok} ({err:.1e}) | {whole:.3f} | {t_scores:.3f} | {t_choice:.3f} | {t_sparse:.3f} "
            f"| {plain_ms:.3f} | {plain_ms / whole:.2f}x |"
        )
        print(rows[-1], flush=True)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
