"""The builders of the bench's short and code workloads: ``chat``, ``shared-prefix``,
``long-context``, ``code-completion`` and ``extractive`` (each a function of the build context:
its prompts and workload-specific stats)."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from .base import BuildContext, Prompt, WorkloadError
from .sources import _functions, _stdlib_windows, stdlib_files

#: Target prompt length of ``long-context`` (tokens), shortened when the output would not fit.
LONG_CONTEXT_TOKENS = 1800
LONG_CONTEXT_4K_TOKENS = 3900
#: Target length of the shared prefix of ``shared-prefix`` (tokens).
SHARED_PREFIX_TOKENS = 1024
#: Requests per shared prefix in ``shared-prefix``.
SHARED_PREFIX_GROUP = 8
#: Longest prompt ``code-completion`` takes (tokens); longer function heads are skipped.
CODE_COMPLETION_MAX_TOKENS = 512


# ---------------------------------------------------------------------------- workloads
CHAT_QUESTIONS = (
    "How do I read a text file line by line in Python?",
    "What is the difference between a list and a tuple?",
    "How can I reverse a string?",
    "Write a function that checks whether a number is prime.",
    "How do I sort a dictionary by its values?",
    "What does the yield keyword do?",
    "How do I merge two dictionaries?",
    "How can I run a shell command and capture its output?",
    "What is a context manager and when should I write one?",
    "How do I parse a JSON string into a dict?",
    "Explain list comprehensions with an example.",
    "How do I get the current date and time?",
    "How can I remove duplicates from a list but keep the order?",
    "What is the difference between is and ==?",
    "How do I make an HTTP request with the standard library?",
    "Write a class that represents a stack.",
    "How do I count the words in a file?",
    "How can I measure how long a function takes to run?",
    "What are *args and **kwargs?",
    "How do I create a temporary directory?",
    "How do I write a unit test for a function?",
    "How do I split a path into folder and file name?",
    "Write a generator that yields Fibonacci numbers.",
    "How can I catch several exceptions in one except clause?",
    "How do I format a float with two decimals?",
    "What is the GIL?",
    "How do I iterate over two lists at the same time?",
    "How can I check whether a file exists?",
    "Write a function that flattens a nested list.",
    "How do I read environment variables?",
    "How do I use a regular expression to find all numbers in a string?",
    "What is a decorator? Show a small example.",
)

CHAT_FORMATS = (
    "User: {q}\nAssistant:",
    "Q: {q}\nA:",
    "# Question: {q}\n# Answer:",
    "User: Hi!\nAssistant: Hello! How can I help you today?\nUser: {q}\nAssistant:",
    "### Instruction\n{q}\n\n### Response:",
)


def _chat(ctx: BuildContext) -> tuple[list[Prompt], dict[str, Any]]:
    rng = ctx.rng("chat")
    combos = [(q, f) for q in range(len(CHAT_QUESTIONS)) for f in range(len(CHAT_FORMATS))]
    rng.shuffle(combos)
    prompts = []
    for i in range(ctx.num_prompts):
        q, f = combos[i % len(combos)]
        text = CHAT_FORMATS[f].format(q=CHAT_QUESTIONS[q])
        prompts.append(ctx.make("chat", i, ctx.tokenizer.encode(text), f"question {q}, format {f}", text=text))
    return prompts, {}


SYSTEM_PROMPT = '''"""You are a careful Python assistant working on the standard library.

Answer every task with one function in the style of the examples below: a short
docstring that says what the function returns, standard-library imports only,
no global state, and clear names. Keep functions short; prefer early returns.
"""

'''


def _shared_prefix(ctx: BuildContext) -> tuple[list[Prompt], dict[str, Any]]:
    tok = ctx.tokenizer
    files = stdlib_files(ctx.stdlib)
    question_budget = 160
    prefix_target = min(SHARED_PREFIX_TOKENS, ctx.prompt_budget - question_budget)
    if prefix_target < 64:
        raise WorkloadError(
            f"shared-prefix: max_tokens {ctx.max_tokens} leaves too little room "
            f"for a shared prefix in max_model_len {ctx.max_model_len}"
        )
    questions = (
        h
        for h in _functions(ctx, "shared-prefix", files, "questions")
        if len(tok.encode(h.head)) <= question_budget - 8
    )
    prompts: list[Prompt] = []
    shared: list[int] = []
    n_groups = -(-ctx.num_prompts // SHARED_PREFIX_GROUP)
    for g in range(n_groups):
        # The group's prefix: the system prompt, then few-shot examples until the target length.
        prefix = SYSTEM_PROMPT
        k = 0
        for ex in _functions(ctx, "shared-prefix", files, "examples", g):
            if len(ex.source.splitlines()) > 40:
                continue
            candidate = prefix + f"# Example {k + 1}\n{ex.source}\n\n"
            if len(tok.encode(candidate)) > prefix_target:
                if k >= 1:
                    break
                continue
            prefix, k = candidate, k + 1
        group_ids = []
        for j in range(min(SHARED_PREFIX_GROUP, ctx.num_prompts - g * SHARED_PREFIX_GROUP)):
            q = next(questions)
            text = prefix + f"# Task {k + 1}\n{q.head}"
            ids = tok.encode(text)
            prompts.append(ctx.make("shared-prefix", len(prompts), ids, f"{q.path}:{q.qualname}", group=g, text=text))
            group_ids.append(ids)
        shared.append(len(_common_prefix(group_ids)) if len(group_ids) > 1 else 0)
    return prompts, {"group_size": SHARED_PREFIX_GROUP, "shared_prefix_tokens": shared}


def _common_prefix(seqs: Sequence[Sequence[int]]) -> list[int]:
    if not seqs:
        return []
    out = []
    for column in zip(*seqs):
        if any(c != column[0] for c in column):
            break
        out.append(column[0])
    return out


def _long_context(
    ctx: BuildContext, *, name: str = "long-context", tokens: int = LONG_CONTEXT_TOKENS
) -> tuple[list[Prompt], dict[str, Any]]:
    tok = ctx.tokenizer
    length = min(tokens, ctx.prompt_budget)
    if length < 256:
        raise WorkloadError(
            f"{name}: max_tokens {ctx.max_tokens} leaves only {length} prompt "
            f"tokens in max_model_len {ctx.max_model_len} (needs at least 256)"
        )
    root = ctx.stdlib
    windows = itertools.islice(_stdlib_windows(tok, root, ctx.rng(name), length), ctx.num_prompts)
    prompts = [ctx.make(name, i, ids, source) for i, (ids, source) in enumerate(windows)]
    if len(prompts) < ctx.num_prompts:
        raise WorkloadError(
            f"{name}: only {len(prompts)} stdlib files in {root} are long "
            f"enough for {length}-token prompts; {ctx.num_prompts} asked"
        )
    return prompts, {"prompt_tokens_target": length}


def _long_context_4k(ctx: BuildContext) -> tuple[list[Prompt], dict[str, Any]]:
    return _long_context(ctx, name="long-context-4k", tokens=LONG_CONTEXT_4K_TOKENS)


def _code_completion(ctx: BuildContext) -> tuple[list[Prompt], dict[str, Any]]:
    tok = ctx.tokenizer
    limit = min(CODE_COMPLETION_MAX_TOKENS, ctx.prompt_budget)
    prompts: list[Prompt] = []
    for head in _functions(ctx, "code-completion", stdlib_files(ctx.stdlib)):
        if len(prompts) == ctx.num_prompts:
            break
        ids = tok.encode(head.head)
        if len(ids) > limit:
            continue
        prompts.append(ctx.make("code-completion", len(prompts), ids, f"{head.path}:{head.qualname}", text=head.head))
    if len(prompts) < ctx.num_prompts:
        raise WorkloadError(f"code-completion: only {len(prompts)} functions found in {ctx.stdlib}")
    return prompts, {}


#: Longest function copied by ``extractive`` (lines).
EXTRACTIVE_MAX_LINES = 30


def _extractive(ctx: BuildContext) -> tuple[list[Prompt], dict[str, Any]]:
    """A whole stdlib function, then a comment asking for it again and its first line: the
    continuation that fits is a copy of text in the prompt (what prompt-lookup, trie and
    n-gram drafting are for)."""
    tok = ctx.tokenizer
    prompts: list[Prompt] = []
    for fn in _functions(ctx, "extractive", stdlib_files(ctx.stdlib)):
        if len(prompts) == ctx.num_prompts:
            break
        lines = fn.source.splitlines()
        if not 4 <= len(lines) <= EXTRACTIVE_MAX_LINES:
            continue
        first = next((i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "async def "))), 0)
        text = (
            fn.source.rstrip() + "\n\n\n# The same function again, unchanged:\n" + "\n".join(lines[: first + 1]) + "\n"
        )
        ids = tok.encode(text)
        if len(ids) > ctx.prompt_budget:
            continue
        prompts.append(ctx.make("extractive", len(prompts), ids, f"{fn.path}:{fn.qualname}", text=text))
    if len(prompts) < ctx.num_prompts:
        raise WorkloadError(f"extractive: only {len(prompts)} short functions found in {ctx.stdlib}")
    return prompts, {}
