"""What `lookahead`'s drafting costs in Python, per request and per step, with each request's
prompt matched in its own index (the default) and with every prompt window inserted into the
shared trie (``shared_prompts: true``). No engine: random tokens, one request.

    .venv/bin/python benchmarks/lookahead_propose.py [--prompt-tokens 1800] [--vocab 2000]

Prints, per mode, the median of the first ``propose`` of a fresh proposer on the prompt (the
prompt's indexing or insertion) and the median ``propose`` of the steps after it, one new token
each.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import median_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=1800)
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()

    from vllm_graft.hooks.manager import get_registry

    entry = get_registry().get("speculative", "lookahead")
    cls = entry.registration.load()
    rng = random.Random(0)
    prompt = [rng.randrange(args.vocab) for _ in range(args.prompt_tokens)]
    print("| mode | first propose ms | per-step propose us |")
    print("|---|---:|---:|")
    for shared in (False, True):
        params = entry.registration.params(shared_prompts=shared)
        first = median_ms(lambda: cls(params).propose("r", prompt, 4), repeat=9)
        p = cls(params)
        seq = list(prompt)
        p.propose("r", seq, 4)

        def step() -> None:
            seq.append(rng.randrange(args.vocab))
            p.propose("r", seq, 4)

        per_step = median_ms(step, repeat=args.steps, warmup=0) * 1e3
        print(f"| shared_prompts: {str(shared).lower()} | {first:.2f} | {per_step:.1f} |")


if __name__ == "__main__":
    main()
