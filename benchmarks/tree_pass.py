"""Per-call CPU timings of one tree's masked verify pass (``_tree.verify_pass_attention``) at the
tiny Llama's shapes, against the alternatives it was chosen from, beside vLLM's C++ kernel on the
same rows.

    .venv/bin/python benchmarks/tree_pass.py [--repeat 200] [--contexts 300,600] [--rows 5,17,29]

For each cache layout (``cpu_vec``: vLLM's own write for its ``vec`` ISA; ``blocked``: the graft's
write where that ISA is not checked), context length L (tokens before the pass) and pass size R
(the root and R - 1 nodes of a random tree), on one sequence in a shuffled block table:

* ``matmul``: the pass as it was before issue 37, gathered keys/values in float32, then matmul,
  masked softmax, matmul per KV head group;
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with the boolean mask and
  ``enable_gqa`` over the same gathered context (float32);
* ``bmm``: ``verify_pass_attention`` as it is now: two batched matmuls over the KV heads, the
  keys gathered transposed ``[Hkv, D, S]`` (per block that is how ``cpu_vec`` holds them), the
  scores scaled and masked in place; ``x`` is ``matmul / bmm``;
* ``vllm``: vLLM's C++ kernel (``ops.cpu_attention_with_kv_cache``) on the same R rows, causal
  (``cpu_vec`` only): what a tree step now pays for its rows before the pass overwrites them;
* ``shared``: the graft's PyTorch paged attention (``plugins/attention/_shared``) on the R rows,
  causal: what the blocked path ran for the rows of requests without a tree.

Each column is the median of ``--repeat`` calls after warm-up (this process's torch threads),
in milliseconds; ``max|d|`` is the largest difference of ``sdpa`` and of ``bmm`` from ``matmul``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder, also when loaded by a test
from _timing import median_ms  # noqa: E402

from vllm_graft.hooks import BLOCKED, CPU_VEC, AttentionLayer, PagedBatch
from vllm_graft.plugins.attention import _shared as shared
from vllm_graft.plugins.speculative._tree import reference
from vllm_graft.plugins.speculative._tree.tree import ancestor_mask

HEADS, KV_HEADS, DIM = 4, 2, 64  # models/graft-tiny-llama/config.json


def _ms(fn: Callable[[], object], repeat: int) -> float:
    return median_ms(fn, repeat, warmup=3)


def _gathered(k_cache, v_cache, block_table, seq_len):
    """The sequence's keys and values ``[Hkv, seq_len, D]`` (float32) gathered from the paged cache."""
    hkv, bs, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    nb = -(-seq_len // bs)
    ids = block_table[:nb].long()
    keys = k_cache[ids].transpose(0, 1).reshape(hkv, nb * bs, d)[:, :seq_len].float()
    values = v_cache[ids].transpose(0, 1).reshape(hkv, nb * bs, d)[:, :seq_len].float()
    return keys, values


def matmul_pass(q, k_cache, v_cache, block_table, seq_len, pass_mask, scale):
    """The masked pass as ``verify_pass_attention`` computed it before: float32 matmul/softmax/matmul."""
    r, hq, d = q.shape
    hkv = k_cache.shape[1]
    keys, values = _gathered(k_cache, v_cache, block_table, seq_len)
    group = hq // hkv
    qg = q.float().view(r, hkv, group, d).permute(1, 2, 0, 3)
    scores = torch.matmul(qg, keys.unsqueeze(1).transpose(-1, -2)) * scale
    allowed = torch.ones(r, seq_len, dtype=torch.bool)
    allowed[:, seq_len - r :] = pass_mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), values.unsqueeze(1))
    return out.permute(2, 0, 1, 3).reshape(r, hq, d).to(q.dtype)


def sdpa_pass(q, k_cache, v_cache, block_table, seq_len, pass_mask, scale):
    """The masked pass by ``scaled_dot_product_attention`` (boolean mask, ``enable_gqa``), float32."""
    r, hq, d = q.shape
    keys, values = _gathered(k_cache, v_cache, block_table, seq_len)
    allowed = torch.ones(r, seq_len, dtype=torch.bool)
    allowed[:, seq_len - r :] = pass_mask
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), keys, values, attn_mask=allowed, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1).to(q.dtype)


def _random_tree(nodes: int, g: torch.Generator) -> list[int]:
    return [-1 if i == 0 else int(torch.randint(-1, i, (1,), generator=g)) for i in range(nodes)]


def rows(contexts: list[int], sizes: list[int], block: int, repeat: int, dtype: torch.dtype) -> list[tuple]:
    from vllm import _custom_ops as ops

    g = torch.Generator().manual_seed(0)
    out = []
    scale = DIM**-0.5
    for context in contexts:
        for r in sizes:
            n = context + r
            nb = -(-n // block)
            table = torch.randperm(nb + 3, generator=g)[:nb].to(torch.int32)
            pos = torch.arange(n)
            slots = table[pos // block].long() * block + pos % block
            key = torch.randn(n, KV_HEADS, DIM, generator=g).to(dtype)
            value = torch.randn(n, KV_HEADS, DIM, generator=g).to(dtype)
            q = torch.randn(r, HEADS, DIM, generator=g).to(dtype)
            parents = _random_tree(r - 1, g)
            mask = ancestor_mask([-1, *(p + 1 for p in parents)])
            for layout in (CPU_VEC, BLOCKED):
                kv = torch.zeros(nb + 3, KV_HEADS, block, 2 * DIM, dtype=dtype)
                if layout is CPU_VEC:
                    kc, vc = kv.view(nb + 3, KV_HEADS, 2 * block, DIM).chunk(2, dim=2)
                    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, "vec")
                else:
                    layout.write(key, value, kv, slots)
                k_cache, v_cache = layout.split(kv)
                args = (q, k_cache, v_cache, table, n, mask, scale)
                want = matmul_pass(*args).float()
                err = max(
                    (f(*args).float() - want).abs().max().item() for f in (sdpa_pass, reference.verify_pass_attention)
                )
                t_mm = _ms(lambda: matmul_pass(*args), repeat)
                t_sdpa = _ms(lambda: sdpa_pass(*args), repeat)
                t_bmm = _ms(lambda: reference.verify_pass_attention(*args), repeat)
                qsl = torch.tensor([0, r], dtype=torch.int32)
                lens = torch.tensor([n], dtype=torch.int32)
                t_vllm = float("nan")
                if layout is CPU_VEC:
                    sched = ops.cpu_attn_get_scheduler_metadata(
                        num_reqs=1,
                        num_heads=HEADS,
                        num_kv_heads=KV_HEADS,
                        head_dim=DIM,
                        seq_lens=lens,
                        dtype=dtype,
                        query_start_loc=qsl,
                        causal=True,
                        sliding_window_size=-1,
                        isa="vec",
                        enable_kv_split=False,
                    )
                    o = torch.empty_like(q)

                    def kernel(o=o, kc=kc, vc=vc, sched=sched, qsl=qsl, lens=lens, table=table):
                        ops.cpu_attention_with_kv_cache(
                            q, kc, vc, o, qsl, lens, scale, True, None, -1, table[None], 0.0, sched, None
                        )

                    t_vllm = _ms(kernel, repeat)
                batch = PagedBatch(qsl, lens, table[None], max_query_len=r)
                spec = AttentionLayer(HEADS, KV_HEADS, DIM, scale, block, kv_layout=layout)
                t_shared = _ms(lambda: shared.paged_attention(q, kv, batch, spec), repeat)
                out.append((layout.name, context, r, t_mm, t_sdpa, t_bmm, t_vllm, t_shared, err))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--contexts", default="300,600")
    ap.add_argument("--rows", default="5,17,29")
    ap.add_argument("--block", type=int, default=128, help="KV block size (vLLM's CPU default: 128)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    contexts = [int(x) for x in args.contexts.split(",")]
    sizes = [int(x) for x in args.rows.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, block {args.block}")
    print(
        f"{'layout':8} {'L':>5} {'R':>3} {'matmul ms':>10} {'sdpa ms':>8} {'bmm ms':>7} {'x':>5} "
        f"{'vllm ms':>8} {'shared ms':>10} {'max|d|':>8}"
    )
    for layout, context, r, t_mm, t_sdpa, t_bmm, t_vllm, t_shared, err in rows(
        contexts, sizes, args.block, args.repeat, dtype
    ):
        print(
            f"{layout:8} {context:5d} {r:3d} {t_mm:10.3f} {t_sdpa:8.3f} {t_bmm:7.3f} {t_mm / t_bmm:5.2f} "
            f"{t_vllm:8.3f} {t_shared:10.3f} {err:8.1e}"
        )


if __name__ == "__main__":
    main()
