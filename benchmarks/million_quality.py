"""The KV storage formats (million's product-quantised KV, xquant's rematerialised latents) against
plain vLLM and kv4 on the same texts: KV bytes per token, the blocks the same KV memory holds,
perplexity and greedy agreement.

For each arm (plain, kv4, million with ``--codebooks``; xquant4 / xquant2 with ``--bases`` at 4 / 2
bits, xquant-id4 / xquant-id2 the same quantisation of the post-RoPE K/V without the latent), one in-process vLLM CPU engine on
``--model`` (default SmolLM2-135M, ``--dtype`` float32):

* **bytes/token/head**: one block's page bytes over block size and KV heads (K and V together);
  **blocks**: what vLLM allocated in the same ``VLLM_CPU_KVCACHE_SPACE``;
* **ppl**: perplexity of ``--texts`` windows of ``--tokens`` tokens of standard-library source
  (held out: seed ``--seed``, files the codebooks were calibrated on left out) and of
  ``--prose`` (deployments/calibration/prose.txt by default), from vLLM's prompt log-probabilities:
  every prompt token's attention reads the stored (quantised) K/V, the prefill's own tokens included;
* **greedy agree**: the fraction of ``--gen`` greedy tokens after the first 64 tokens of each
  text that equal plain's, position by position;
* **decode tok/s**: that generation's tokens over its wall time (only meaningful on a quiet machine).

    python benchmarks/million_quality.py --codebooks ~/.cache/vllm-graft/million/smollm2-135m.safetensors
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

ROOT = Path(__file__).resolve().parents[1]


def held_out_texts(tok, num: int, tokens: int, seed: int) -> list[tuple[list[int], str]]:
    """``num`` stdlib windows of ``tokens`` tokens (``seed``), none from a file that
    ``vllm-graft calibrate million``'s default windows (seed 0, 512 tokens, up to 16 of them) read."""
    from vllm_graft.tools.workloads import stdlib_texts

    seen = {where.split("@")[0] for _, where in stdlib_texts(tok, num=16, tokens=512, seed=0)}
    out = []
    for ids, where in stdlib_texts(tok, num=num + len(seen) + 4, tokens=tokens, seed=seed):
        if where.split("@")[0] not in seen:
            out.append((list(ids), where))
    return out[:num]


def run_arm(model: str, dtype: str, kvcompress, texts, prose, gen: int, max_len: int) -> dict:
    from vllm import SamplingParams

    from vllm_graft.integration.plan import plan_for
    from vllm_graft.launch.engine import in_process_engine

    data = {"model": model, "engine": {"dtype": dtype, "max_model_len": max_len, "enforce_eager": True}}
    if kvcompress:
        data["kvcompress"] = kvcompress
    with in_process_engine(plan_for(data), graft=bool(kvcompress), seed=0) as llm:
        core = llm.llm_engine.engine_core.engine_core
        config = core.scheduler.kv_cache_config
        (group,) = config.kv_cache_groups
        spec = group.kv_cache_spec
        per_token = spec.page_size_bytes / (spec.block_size * spec.num_kv_heads)
        nll = {}
        for name, prompts in (("code", [t for t, _ in texts]), ("prose", [prose] if prose else [])):
            if not prompts:
                continue
            sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            total, n = 0.0, 0
            for p, o in zip(prompts, outs):
                for t, lp in zip(p[1:], o.prompt_logprobs[1:]):
                    total -= lp[t].logprob
                    n += 1
            nll[name] = math.exp(total / n)
        sp = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
        heads = [{"prompt_token_ids": t[:64]} for t, _ in texts]
        t0 = time.perf_counter()
        outs = llm.generate(heads, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {
        "bytes_per_token_head": per_token,
        "blocks": config.num_blocks,
        "page_bytes": spec.page_size_bytes,
        "ppl": nll,
        "tokens": tokens,
        "decode_tok_s": sum(map(len, tokens)) / wall,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(Path.home() / ".cache/vllm-graft/models/smollm2-135m"))
    p.add_argument("--codebooks", help="million's codebook file for --model (the million arm)")
    p.add_argument("--bases", help="xquant's bases file for --model (the xquant arms)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--texts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=7, help="the held-out stdlib windows' seed (calibration: 0)")
    p.add_argument("--prose", default=str(ROOT / "deployments" / "calibration" / "prose.txt"))
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--arms", default="plain,kv4,million")
    p.add_argument("--json", metavar="FILE", help="write the results")
    p.add_argument("--compare", metavar="FILE", action="append", default=[],
                   help="results of earlier runs (--json) on the same texts to show beside these")
    args = p.parse_args()

    from vllm_graft.tools.workloads import Tokenizer

    tok = Tokenizer.from_model(args.model)
    texts = held_out_texts(tok, args.texts, args.tokens, args.seed)
    prose = tok.encode(Path(args.prose).read_text()) if args.prose else []
    arms = {
        "plain": None,
        "kv4": {"plugin": "kv4"},
        "million": {"plugin": "million", "params": {"codebooks": args.codebooks}},
        **{
            f"xquant{tag}{bits}": {"plugin": "xquant", "params": {"bases": bases, "bits": bits}}
            for tag, bases in (("", args.bases), ("-id", "identity"))
            for bits in (2, 4, 8)
        },
    }
    results = {}
    for f in args.compare:
        results.update(json.loads(Path(f).read_text()))
    for name in args.arms.split(","):
        results[name] = run_arm(args.model, args.dtype, arms[name], texts, prose, args.gen, args.tokens + 64)
    base = results.get("plain")
    print(f"{args.model} {args.dtype}: {len(texts)} held-out stdlib texts of {args.tokens} tokens "
          f"(seed {args.seed}) + prose ({len(prose)} tokens); greedy: {args.gen} tokens after 64")
    print(f"{'arm':11} {'B/tok/head':>10} {'blocks':>7} {'ppl code':>9} {'ppl prose':>9} {'agree':>6} {'tok/s':>6}")
    for name, r in results.items():
        agree = ""
        if base is not None:
            same = sum(x == y for a, b in zip(base["tokens"], r["tokens"]) for x, y in zip(a, b))
            agree = f"{same / sum(map(len, base['tokens'])):.3f}"
        print(f"{name:11} {r['bytes_per_token_head']:>10.1f} {r['blocks']:>7} {r['ppl'].get('code', float('nan')):>9.3f} "
              f"{r['ppl'].get('prose', float('nan')):>9.3f} {agree:>6} {r['decode_tok_s']:>6.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
