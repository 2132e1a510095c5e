"""Which of a RULER needle's tokens a kvpress press drops, layer by layer and head by head.

kvpress's token-granular presses scored 0 on the RULER suite on SmolLM2-135M at every ratio while
plain scored 0.77 (docs/benchmarks/kvcompress.md#ruler-on-smollm2-135m). This probe shows why, on
kvbench's own prompts: for each ``--ratio`` it runs the press over a ``single`` case through
kvpress_compare's driver (kvpress's own prefill and greedy decode), prints the answer, and for a
scorer press lists the KV heads that dropped any of the needle's value tokens, with the lowest
score the press gave them beside the layer's median. SmolLM2's tokenizer gives a 7-digit value 7
tokens; a head that drops one digit can break the copy. Presses without a per-token score
(KVzip) print only the answer.

    .venv-kvpress/bin/python benchmarks/kvpress_needle_probe.py --press SnapKVPress --ratio 0.01,0.25,0.5

Never starts vLLM (kvpress's environment, ``make kvpress``).
"""

from __future__ import annotations

import argparse
import os


def main() -> int:
    import kvpress
    import torch

    from vllm_graft.tools.kvcompress import kvpress_compare as K
    from vllm_graft.tools.workloads import Tokenizer
    from vllm_graft.tools.workloads.ruler import ruler_suite, score_case

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.expanduser("~/.cache/vllm-graft/models/smollm2-135m"))
    p.add_argument("--press", default="SnapKVPress", help="a kvpress class taking compression_ratio")
    p.add_argument("--ratio", default="0.01,0.25,0.5", help="kvpress compression ratios (the share removed)")
    p.add_argument("--case", type=int, default=0, help="which `single` case (kvbench's seed)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--form", default="noise")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()

    tok = Tokenizer.from_model(a.model)
    case = ruler_suite(tok, tasks=["single"], num_per_task=a.case + 1, context_tokens=a.context, form=a.form)[-1]
    ids, value = list(case.token_ids), list(case.answers[0])[1:]  # the value's tokens, without the space
    at = next(i for i in range(len(ids)) if ids[i : i + len(value)] == value)
    print(f"needle value {tok.decode(value)!r}: {len(value)} tokens at {at}..{at + len(value) - 1} of {len(ids)}")
    cls = getattr(kvpress, a.press)
    scores: dict[int, torch.Tensor] = {}
    if hasattr(cls, "score"):
        orig = cls.score

        def score(self, module, *args, **kwargs):  # noqa: ANN001, ANN202
            s = orig(self, module, *args, **kwargs)
            scores[int(module.layer_idx)] = s.detach()
            return s

        cls.score = score
    runner = K.Runner(a.model, threads=a.threads)
    out, _ = runner.generate("sdpa", None, ids, 10, None)
    print(f"plain: {tok.decode(out)!r} score {score_case(case, out)}")
    for ratio in (float(r) for r in a.ratio.split(",")):
        scores.clear()
        out, held = runner.generate("sdpa", cls(compression_ratio=ratio), ids, 10, None)
        print(f"{a.press}({ratio}): {tok.decode(out)!r} score {score_case(case, out)}, first layer holds {held}")
        for layer, s in sorted(scores.items()):
            s = s[0]  # heads x tokens
            kept = s.topk(held, dim=-1).indices
            for h in range(s.shape[0]):
                lost = sorted(set(range(at, at + len(value))) - set(kept[h].tolist()))
                if lost:
                    print(
                        f"  layer {layer} head {h}: drops value tokens {[p - at for p in lost]} "
                        f"(lowest score {float(s[h, at : at + len(value)].min()):.2e}, layer median {float(s.median()):.2e})"
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
