"""Long-context builders: needle-in-a-haystack retrieval prompts (KV compression) and the
``long-recall`` workload (a function repeated at the end of a long source window)."""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .base import BuildContext, Prompt, Tokenizer, WorkloadError
from .prompts import LONG_CONTEXT_TOKENS
from .sources import _read, stdlib_files, stdlib_texts


@dataclass(frozen=True)
class Needle:
    """One needle-in-a-haystack retrieval prompt: ``token_ids`` ends where the model must
    copy ``answer_ids`` (exact match: the greedy output starts with them)."""

    token_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]
    depth: float  # where the needle sits in the haystack (0 = start, 1 = end)
    source: str


def needle_haystack(
    tokenizer: Tokenizer, *, num_prompts: int, context_tokens: int, seed: int = 0, root: Path | None = None
) -> list[Needle]:
    """Needle-in-a-haystack retrieval on code: a stdlib source window of about
    ``context_tokens`` tokens (the haystack) with one line ``SECRET_<tag> = "<value>"``
    inserted at a line boundary at depth 0.1-0.9 (evenly over the prompts); the prompt ends
    with ``SECRET_<tag> = "``, so the answer is ``<value>"`` copied from the needle line
    (a random tag and an 8-letter random value per prompt, seeded)."""
    rng = random.Random(f"vllm-graft-needle:{seed}:{context_tokens}")
    tail_budget = 32  # the needle line and the question
    texts = stdlib_texts(tokenizer, num=num_prompts, tokens=context_tokens - tail_budget, seed=seed, root=root)
    out = []
    for i, (ids, source) in enumerate(texts):
        tag = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(4))
        value = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(8))
        depth = 0.1 + 0.8 * (i / max(1, num_prompts - 1))
        hay = tokenizer.decode(ids)
        lines = hay.splitlines(keepends=True)
        at = max(1, min(len(lines) - 1, round(depth * len(lines))))
        needle = f'SECRET_{tag} = "{value}"\n'
        question = f'\nSECRET_{tag} = "'
        text = "".join(lines[:at]) + needle + "".join(lines[at:]).rstrip("\n") + "\n" + question
        prompt = tokenizer.encode(text)[-(context_tokens - 1) :]
        full = tokenizer.encode(text + value + '"')
        answer = full[len(tokenizer.encode(text)) :]
        if not answer or tokenizer.encode(text) + answer != full:
            answer = tokenizer.encode(value + '"')  # the tokenizer merges across the boundary
        out.append(Needle(tuple(prompt), tuple(answer), round(depth, 3), source))
    return out


#: Shortest and longest function repeated at the end of a ``long-recall`` prompt (tokens).
LONG_RECALL_SPAN = (128, 384)
#: Fewest tokens before the function's first copy (it must not sit among attention sinks).
LONG_RECALL_LEAD = 64


def _long_recall(ctx: BuildContext) -> tuple[list[Prompt], dict[str, Any]]:
    """A ~1800-token window of a stdlib file that begins shortly before a function, whose last
    few hundred tokens repeat that function token for token: predicting the repeat needs the
    first copy, which lies at least half the context back (beyond any recent window up to half
    the budget). The stats give each prompt's repeated span (``scored_spans``) and distance."""
    tok = ctx.tokenizer
    length = min(LONG_CONTEXT_TOKENS, ctx.prompt_budget)
    lo, hi = LONG_RECALL_SPAN
    if length < 4 * lo:
        raise WorkloadError(
            f"long-recall: max_tokens {ctx.max_tokens} leaves only {length} prompt "
            f"tokens in max_model_len {ctx.max_model_len} (needs at least {4 * lo})"
        )
    hi = min(hi, length // 4)
    rng = ctx.rng("long-recall")
    root = ctx.stdlib
    files = [f for f in stdlib_files(root) if (root / f).stat().st_size >= 5 * length]
    rng.shuffle(files)
    prompts: list[Prompt] = []
    spans: list[list[int]] = []
    distances: list[int] = []
    for rel in files:
        if len(prompts) == ctx.num_prompts:
            break
        text = _read(root, rel)
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        starts = [0]
        for line in text.splitlines(keepends=True):
            starts.append(starts[-1] + len(line))
        fns = sorted(
            (n.lineno, n.end_lineno)
            for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and not n.decorator_list
            and n.end_lineno is not None
            and n.lineno > 8
        )
        rng.shuffle(fns)
        for first, last in fns[:12]:
            repeat = text[starts[first - 1] : starts[last]]
            rep = tok.encode(repeat)
            if not lo <= len(rep) <= hi or len(text) - starts[first - 1] < 5 * length:
                continue
            # The window starts a few lines (at least LONG_RECALL_LEAD tokens) before the function.
            begin = starts[max(0, first - 1 - rng.randint(6, 20))]
            # The longest run of whole lines from there that leaves room for the repeat.
            room = length - len(rep)
            ends = [s for s in starts if begin < s <= begin + 8 * length]
            lo_k, hi_k = 0, len(ends) - 1
            while lo_k < hi_k:  # the last line end whose text fits in `room` tokens
                mid = (lo_k + hi_k + 1) // 2
                if len(tok.encode(text[begin : ends[mid]])) <= room:
                    lo_k = mid
                else:
                    hi_k = mid - 1
            filler = tok.encode(text[begin : ends[lo_k]])
            ids = filler + rep
            r = len(filler)
            # The first copy, token for token, inside the filler.
            o = next((i for i in range(len(filler) - len(rep) + 1) if filler[i : i + len(rep)] == rep), None)
            if o is None or o < LONG_RECALL_LEAD or r - o < len(ids) // 2 or len(ids) < length - 64:
                continue
            prompts.append(ctx.make("long-recall", len(prompts), ids, f"{rel}:{first}-{last}@{begin}"))
            spans.append([r, len(ids)])
            distances.append(r - o)
            break
    if len(prompts) < ctx.num_prompts:
        raise WorkloadError(
            f"long-recall: only {len(prompts)} stdlib files in {root} give a "
            f"{length}-token window with a repeatable function; {ctx.num_prompts} asked"
        )
    return prompts, {"prompt_tokens_target": length, "scored_spans": spans, "recall_distance": distances}
