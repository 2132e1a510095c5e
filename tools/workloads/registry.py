"""The registry of the built-in workloads (name -> :class:`~.base.Workload`, in the order
``all`` runs them), ``--workload`` parsing and :func:`build`, the prompt sets of named
workloads."""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Sequence

from .base import BuildContext, PromptSet, Tokenizer, Workload, WorkloadError
from .long_context import LONG_RECALL_SPAN, _long_recall
from .prompts import (
    EXTRACTIVE_MAX_LINES,
    LONG_CONTEXT_4K_TOKENS,
    LONG_CONTEXT_TOKENS,
    SHARED_PREFIX_GROUP,
    SHARED_PREFIX_TOKENS,
    _chat,
    _code_completion,
    _extractive,
    _long_context,
    _long_context_4k,
    _shared_prefix,
)
from .sources import stdlib_dir


class UnknownWorkloadError(WorkloadError):
    def __init__(self, unknown: Sequence[str]) -> None:
        self.unknown = list(unknown)
        parts = []
        for name in unknown:
            close = difflib.get_close_matches(name, list(WORKLOADS), n=1)
            parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        super().__init__(
            f"unknown workload{'s' if len(unknown) != 1 else ''} {', '.join(parts)}; accepted: {', '.join(WORKLOADS)}"
        )


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "chat",
            "short chat-style prompts (10-40 tokens)",
            "Short chat-style prompts: a question about everyday Python (32 in code) in one of five "
            "conversation formats ('User: ...\\nAssistant:', 'Q: ...\\nA:', a one-turn greeting first, "
            "...); question x format pairs in a seeded order. Decode-dominated, small batch of short "
            "contexts.",
            _chat,
        ),
        Workload(
            "shared-prefix",
            f"groups of {SHARED_PREFIX_GROUP} requests sharing a ~{SHARED_PREFIX_TOKENS}-token prefix",
            f"Requests in groups of {SHARED_PREFIX_GROUP} that share a long common prefix: a system prompt "
            f"(a docstring of instructions) and few-shot examples (whole stdlib functions of at most 40 "
            f"lines) up to ~{SHARED_PREFIX_TOKENS} tokens, then a different task each: the head of "
            "another stdlib function. Each group has its own examples. What prefix caching and "
            "shared-prefix attention (Hydragen) are for.",
            _shared_prefix,
        ),
        Workload(
            "long-context",
            f"~{LONG_CONTEXT_TOKENS}-token Python source windows, continued",
            f"Code continuation at long context: {LONG_CONTEXT_TOKENS} tokens of a stdlib .py file "
            "(a seeded file among those long enough, from a seeded line), shortened so that prompt + "
            "output fit max_model_len. Prefill-heavy; decode attends over ~2K tokens: what KV "
            "compression and sparse attention are for.",
            _long_context,
        ),
        Workload(
            "code-completion",
            "heads of stdlib functions (signature, docstring, first line)",
            "Code completion: the beginning of a function from the standard library sources of the "
            "running interpreter (decorators, signature, docstring and the first statement's first "
            "line, dedented; functions with at least two statements after the docstring), one function "
            "per file, files and functions in a seeded order. Repetitive code: what n-gram and suffix "
            "speculation are for.",
            _code_completion,
        ),
        Workload(
            "extractive",
            "a stdlib function, then a request to write it again (copying)",
            "Extractive / repetitive: a whole function from the standard library (4 to "
            f"{EXTRACTIVE_MAX_LINES} lines, one per file, seeded order), then '# The same function "
            "again, unchanged:' and its signature line: the fitting continuation copies the prompt. "
            "What prompt-lookup, trie (Lookahead) and n-gram speculation are for.",
            _extractive,
        ),
        Workload(
            "long-recall",
            f"~{LONG_CONTEXT_TOKENS}-token source windows ending with a repeat of an early function",
            f"Long-range recall at long context: a ~{LONG_CONTEXT_TOKENS}-token window of a stdlib .py file "
            "(seeded file) starting 6-20 lines before a function (no decorators, "
            f"{LONG_RECALL_SPAN[0]}-{LONG_RECALL_SPAN[1]} tokens), whole lines of the file after it, then "
            "that function again token for token as the last tokens of the prompt. Its first copy lies "
            "at least half the prompt back, so a recent window cannot see it: predicting the repeat "
            "needs retrieval from the middle of the context (what sparse attention must keep). The "
            "stats name each prompt's repeated span (scored_spans) and the distance to its first copy.",
            _long_recall,
        ),
        Workload(
            "long-context-4k",
            f"~{LONG_CONTEXT_4K_TOKENS}-token Python source windows, continued",
            f"As long-context, at {LONG_CONTEXT_4K_TOKENS} tokens (needs max_model_len above that, so it "
            "is not in `all` for the bundled 2K models): decode attends over ~4K tokens, the context "
            "sparse decode attention is measured at.",
            _long_context_4k,
            in_all=False,
        ),
    )
}


def parse_names(values: Sequence[str] | None) -> list[str]:
    """``--workload`` values (repeatable, each a comma list) -> workload names in the given
    order, duplicates dropped; none given -> all (those ``in_all``: every one but
    long-context-4k, which needs a longer context than the bundled models'). Raises
    :class:`UnknownWorkloadError`."""
    if not values:
        return [n for n, w in WORKLOADS.items() if w.in_all]
    names: list[str] = []
    for value in values:
        for part in value.split(","):
            part = part.strip()
            if part == "all":
                names += [n for n, w in WORKLOADS.items() if w.in_all and n not in names]
            elif part and part not in names:
                names.append(part)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise UnknownWorkloadError(unknown)
    if not names:
        raise WorkloadError(f"no workload named; accepted: {', '.join(WORKLOADS)}")
    return names


def build(
    names: Sequence[str],
    tokenizer: Tokenizer,
    *,
    num_prompts: int,
    max_tokens: int,
    max_model_len: int,
    seed: int = 0,
    stdlib: str | os.PathLike[str] | None = None,
) -> list[PromptSet]:
    """The prompt sets of the named workloads (deterministic in all arguments)."""
    if num_prompts < 1:
        raise WorkloadError(f"num_prompts must be at least 1 (got {num_prompts})")
    if max_tokens < 1 or max_tokens > max_model_len - 2:
        raise WorkloadError(
            f"max_tokens must be between 1 and {max_model_len - 2} for max_model_len {max_model_len} (got {max_tokens})"
        )
    ctx = BuildContext(
        tokenizer, num_prompts, max_tokens, max_model_len, seed, Path(stdlib) if stdlib is not None else stdlib_dir()
    )
    out = []
    for name in parse_names(names):
        workload = WORKLOADS[name]
        prompts, stats = workload.build(ctx)
        assert len(prompts) == num_prompts, (name, len(prompts))
        out.append(PromptSet(workload, prompts, stats))
    return out
