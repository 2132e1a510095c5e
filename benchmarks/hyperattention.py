"""hyperattention's figures on SmolLM2-135M's shapes and weights.

``op``: prefill time of the attention op alone, SmolLM2's shapes (9 query heads, 3 KV heads,
head_dim 64), float32: PyTorch's fused causal SDPA (plain) against hyperattention's reference
(``hyper_causal``, its exact pieces through PyTorch's fused CPU attention), at each ``--lens``;
also the scores each computes (the logical saving).

``ppl``: perplexity of SmolLM2-135M (transformers, float32) on one long English text (the
standard library's pydoc topics, CPython's documentation prose) at each ``--lens``, with every
layer's attention (or the last ``--last-layers``) replaced by hyperattention's causal recursion,
against the model's own SDPA on the same tokens.

    python benchmarks/hyperattention.py op --lens 4096 8192
    python benchmarks/hyperattention.py ppl --lens 4096 8192
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import median_ms  # noqa: E402

from vllm_graft.plugins.attention.hyperattention.reference import (  # noqa: E402
    Config,
    Counter,
    hyper_causal,
    hyperplanes,
)

MODEL = Path("~/.cache/vllm-graft/models/smollm2-135m").expanduser()
H, HKV, D = 9, 3, 64


def _cfg(a) -> Config:
    return Config(min_seq_len=a.min_seq_len, block_size=a.block_size, sample_size=a.sample_size)


def op(a) -> None:
    torch.manual_seed(0)
    planes = hyperplanes(D, a.lsh_bits, 0)
    rows = []
    for n in a.lens:
        q, k, v = torch.randn(1, H, n, D), torch.randn(1, HKV, n, D), torch.randn(1, HKV, n, D)
        scale = D**-0.5

        def plain():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

        def hyper():
            return hyper_causal(q[0], k[0], v[0], scale, planes, _cfg(a), torch.Generator().manual_seed(0))

        c = Counter()
        hyper_causal(q[0], k[0], v[0], scale, planes, _cfg(a), torch.Generator().manual_seed(0), c)
        t_plain, t_hyper = median_ms(plain, a.repeat), median_ms(hyper, a.repeat)
        dense = H * n * (n + 1) // 2
        row = {"tokens": n, "sdpa_ms": round(t_plain, 1), "hyper_ms": round(t_hyper, 1),
               "hyper_over_sdpa": round(t_hyper / t_plain, 2), "score_fraction": round(c.scores / dense, 3),
               "rectangles": c.rects, "exact_leaves": c.leaves}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"threads": torch.get_num_threads(), "params": vars(a) | {"func": None}}, default=str))


def _text_ids(tok, n: int) -> list[int]:
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = tok(text)["input_ids"]
    if len(ids) < n:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {n}")
    return ids[:n]


def ppl(a) -> None:
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa").eval()
    n_layers = model.config.num_hidden_layers
    first_hyper = n_layers - (a.last_layers or n_layers)
    planes = hyperplanes(D, a.lsh_bits, 0)
    counter = Counter()
    sdpa = AttentionInterface()["sdpa"] if hasattr(AttentionInterface(), "__getitem__") else None

    def hyper_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        if module.layer_idx < first_hyper:
            return sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kw)
        gen = torch.Generator().manual_seed(1000 + module.layer_idx)
        outs = [hyper_causal(query[b].float(), key[b].float(), value[b].float(), scaling, planes, _cfg(a), gen,
                             counter)[0] for b in range(query.shape[0])]
        return torch.stack(outs).transpose(1, 2).to(query.dtype), None

    AttentionInterface.register("graft_hyper", hyper_attention)
    results = []
    for n in a.lens:
        ids = torch.tensor([_text_ids(tok, n)])
        row = {"tokens": n}
        for arm in ("plain", "hyper"):
            model.config._attn_implementation = "sdpa" if arm == "plain" else "graft_hyper"
            for layer in model.model.layers:
                layer.self_attn.config._attn_implementation = model.config._attn_implementation
            t = time.perf_counter()
            with torch.inference_mode():
                logits = model(ids).logits[0, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
            row[f"{arm}_ppl"] = round(math.exp(float(nll)), 3)
            row[f"{arm}_s"] = round(time.perf_counter() - t, 1)
            del logits
        row["ppl_change_pct"] = round(100 * (row["hyper_ppl"] / row["plain_ppl"] - 1), 2)
        results.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"last_layers": a.last_layers or n_layers, "min_seq_len": a.min_seq_len,
                      "block_size": a.block_size, "sample_size": a.sample_size, "lsh_bits": a.lsh_bits,
                      "threads": torch.get_num_threads()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["op", "ppl"])
    ap.add_argument("--lens", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--min-seq-len", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--sample-size", type=int, default=256)
    ap.add_argument("--lsh-bits", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=3, help="op: timed calls per arm (the median)")
    ap.add_argument("--last-layers", type=int, default=0, help="ppl: replace only the last N layers (0: all)")
    a = ap.parse_args()
    (op if a.what == "op" else ppl)(a)


if __name__ == "__main__":
    main()
