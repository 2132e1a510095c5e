"""Where a speculative arm's greedy output parts from plain vLLM's, how close the call was.

Reads a ``vllm-graft specbench --json`` file, rebuilds its prompts (the same tokenizer, workloads
and seed), and for every request whose greedy tokens differ from plain's prints the first
differing position and the margin there: log p(top 1) - log p(top 2) of the next token after the
prompt and the common prefix, under transformers on the arm's model folder, in float32 and in
bfloat16. A margin of a few hundredths of a nat in bfloat16 is a near tie that rounding decides (a
verify pass over k+1 tokens runs other GEMM shapes than a one-token decode step); a large one
would point at a bug.

    python benchmarks/greedy_margins.py specbench-bf16.json

Never starts vLLM.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_graft.tools.speculative import specbench as S
    from vllm_graft.tools.workloads import Tokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="a specbench --json file")
    args = p.parse_args()
    data = json.loads(Path(args.json).read_text())
    model = data["model"]
    tok = Tokenizer.from_model(model)
    batches = [b for b in data["batches"] if b > 1]
    total = S.prompts_needed(data["workloads"], data["b1_prompts"], batches)
    # files written before specbench recorded these ran at its defaults on deployments/smollm2 (8192, seed 0)
    sets = S._prompt_sets(
        tok, data["workloads"], total, data["max_tokens"], data.get("max_model_len", 8192), data.get("seed", 0)
    )
    models = {
        dtype: AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()
        for dtype in (torch.float32, torch.bfloat16)
    }

    def margin(ids: list[int], dtype) -> tuple[float, int, int]:
        with torch.no_grad():
            logits = models[dtype](torch.tensor([ids])).logits[0, -1].float()
        lp = torch.log_softmax(logits, -1)
        top = torch.topk(lp, 2)
        return float(top.values[0] - top.values[1]), int(top.indices[0]), int(top.indices[1])

    results = data["results"]
    print("| workload | arm | request | first diff | plain's token / arm's | fp32 margin | bf16 margin |")
    print("|---|---|---|---|---|---|---|")
    for w in data["workloads"]:
        plain = results["plain"][w]["runs"]
        layout = [r for r in S._runs(w, data["b1_prompts"], batches) if r[0] >= 1]
        for arm, per_w in results.items():
            if arm == "plain" or w not in per_w:
                continue
            for run, base, (_, sl, _) in zip(per_w[w]["runs"], plain, layout):
                for i, (a, b) in enumerate(zip(run["greedy_tokens"], base["greedy_tokens"])):
                    if a == b:
                        continue
                    k = next((j for j, (u, v) in enumerate(zip(a, b)) if u != v), min(len(a), len(b)))
                    prompt = list(sets[w][sl.start + i].token_ids)
                    ctx = prompt + b[:k]
                    m32, t32, _ = margin(ctx, torch.float32)
                    m16, t16, _ = margin(ctx, torch.bfloat16)
                    ours = a[k] if k < len(a) else None
                    theirs = b[k] if k < len(b) else None
                    print(
                        f"| {w} | {arm} | {sl.start + i} | {k} | {theirs} / {ours} | {m32:.3f} (top {t32}) "
                        f"| {m16:.3f} (top {t16}) |"
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
