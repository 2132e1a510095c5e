"""Does vLLM's CPU expert kernel skip routing slots of weight 0? (dynamic-topk's question)

dynamic-topk passes a pruned slot as weight 0 on the token's top expert (vLLM's MoE layer
takes a fixed ``[T, top_k]`` routing). This times ``vllm._custom_ops.cpu_fused_moe`` (the
kernel of vLLM's CPU MoE layer, ``CPUUnquantizedExperts``, isa ``vec``) on the same tokens
with:

  top-2             every token: 2 distinct experts, both weighted (the model's routing)
  pruned-dup        a share of tokens: 2nd slot = the 1st expert with weight 0 (what the plugin passes)
  pruned-distinct   the same tokens keep a distinct 2nd expert, but with weight 0
  top-1             a [T, 1] routing (what a real skip would cost)

    .venv/bin/python benchmarks/moe_zero_weight.py [--tokens 256] [--hidden 256] [--inter 128] [--share 0.5]

Timings are medians of --repeat runs; the machine is shared, so compare rows of one run.
(It answers no: the kernel computes weight-0 slots. The MoE adapter now leaves them out itself,
``integration/adapters/moe/skip.py``; ``benchmarks/moe_skip.py`` times vLLM's MoE layer with it.)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inter", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--share", type=float, default=0.5, help="share of tokens pruned to one expert")
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()

    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    torch.manual_seed(0)
    T, H, I, E = args.tokens, args.hidden, args.inter, args.experts
    w13 = cpu_prepack_moe_weight(torch.randn(E, 2 * I, H) * 0.05, "vec")
    w2 = cpu_prepack_moe_weight(torch.randn(E, H, I) * 0.05, "vec")
    x = torch.randn(T, H)
    logits = torch.randn(T, E)
    top_w, top_ids = logits.softmax(-1).topk(2, dim=-1)
    top_w = (top_w / top_w.sum(-1, keepdim=True)).float().contiguous()
    top_ids = top_ids.int().contiguous()
    pruned = torch.rand(T) < args.share

    dup_ids, dup_w = top_ids.clone(), top_w.clone()
    dup_ids[pruned, 1] = dup_ids[pruned, 0]
    dup_w[pruned, 0], dup_w[pruned, 1] = 1.0, 0.0
    dist_w = dup_w.clone()
    one_ids, one_w = top_ids[:, :1].contiguous(), torch.ones(T, 1)

    cases = {"top-2": (top_w, top_ids), "pruned-dup": (dup_w, dup_ids),
             "pruned-distinct": (dist_w, top_ids), "top-1": (one_w, one_ids)}
    out = torch.empty(T, H)
    results = {}
    for name, (w, ids) in cases.items():
        times = []
        for r in range(args.repeat + 3):
            t = time.perf_counter()
            cpu_fused_moe(out, x, w13, w2, None, None, w.contiguous(), ids.contiguous(), "silu", "vec")
            if r >= 3:
                times.append(time.perf_counter() - t)
        results[name] = (statistics.median(times), out.clone())
    # what the weight-0 slots contribute: pruned-dup and pruned-distinct must agree
    agree = torch.allclose(results["pruned-dup"][1], results["pruned-distinct"][1], atol=1e-5)
    base = results["top-2"][0]
    print(f"cpu_fused_moe, T={T} tokens, hidden {H}, intermediate {I}, {E} experts, "
          f"{int(pruned.sum())} tokens ({pruned.float().mean():.0%}) pruned to one expert; "
          f"median of {args.repeat} runs, {torch.get_num_threads()} threads")
    for name, (t, _) in results.items():
        print(f"  {name:16s} {1e6 * t:9.1f} us  ({t / base:5.2f}x top-2)")
    print(f"  weight-0 slots change nothing in the output: {agree}")


if __name__ == "__main__":
    main()
