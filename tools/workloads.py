"""The built-in workloads of `vllm-graft bench`: deterministic prompt sets defined in code.

Every workload is a function of (tokenizer, number of prompts, output budget, context
length, seed) and nothing else, so the two arms of a bench run, and two runs with the same
settings on the same machine, get the same prompt token ids. The code workloads read the
``.py`` sources of the standard library of the running interpreter
(``sysconfig.get_paths()["stdlib"]``), the same folder the bundled models were trained on
(see models/README.md); another Python version has other sources, hence other prompts: the
``fingerprint`` of each prompt set, recorded in bench's JSON, tells whether two runs used
the same prompts.

This module never imports vLLM.
"""
from __future__ import annotations

import ast
import difflib
import hashlib
import itertools
import json
import os
import random
import sysconfig
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

#: Folder names skipped when walking the stdlib (the test suites and third-party packages),
#: as in the models' training corpus (models/corpus.py).
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})

#: Target prompt length of ``long-context`` (tokens), shortened when the output would not fit.
LONG_CONTEXT_TOKENS = 1800
#: Target length of the shared prefix of ``shared-prefix`` (tokens).
SHARED_PREFIX_TOKENS = 1024
#: Requests per shared prefix in ``shared-prefix``.
SHARED_PREFIX_GROUP = 8
#: Longest prompt ``code-completion`` takes (tokens); longer function heads are skipped.
CODE_COMPLETION_MAX_TOKENS = 512


class WorkloadError(ValueError):
    """A workload cannot be built with these settings (or does not exist)."""


class UnknownWorkloadError(WorkloadError):
    def __init__(self, unknown: Sequence[str]) -> None:
        self.unknown = list(unknown)
        parts = []
        for name in unknown:
            close = difflib.get_close_matches(name, list(WORKLOADS), n=1)
            parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        super().__init__(
            f"unknown workload{'s' if len(unknown) != 1 else ''} {', '.join(parts)}; "
            f"accepted: {', '.join(WORKLOADS)}")


# --------------------------------------------------------------------------- tokenizer
class Tokenizer:
    """The model's tokenizer, reduced to what the workloads need (no special tokens added)."""

    def __init__(self, encode: Callable[[str], list[int]], decode: Callable[[Sequence[int]], str],
                 name: str = "") -> None:
        self._encode, self._decode, self.name = encode, decode, name

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode(list(ids))

    @classmethod
    def from_model(cls, model: str | os.PathLike[str]) -> "Tokenizer":
        """A model folder's ``tokenizer.json`` through the `tokenizers` library (fast, no
        transformers import); otherwise transformers' AutoTokenizer (folder or hub id)."""
        folder = Path(model)
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as Fast

            tok = Fast.from_file(str(folder / "tokenizer.json"))
            return cls(lambda t: tok.encode(t, add_special_tokens=False).ids,
                       lambda ids: tok.decode(ids, skip_special_tokens=False), str(folder))
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(model))
        return cls(lambda t: hf(t, add_special_tokens=False)["input_ids"],
                   lambda ids: hf.decode(ids), str(model))


# ----------------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class Prompt:
    workload: str
    index: int
    token_ids: tuple[int, ...]
    text: str
    max_tokens: int  # output budget of this request (the global one, or less to fit the context)
    source: str  # where it came from: "question 3", "json/decoder.py:JSONObject", ...
    group: int | None = None  # shared-prefix group

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "source": self.source, "group": self.group,
                "prompt_tokens": len(self.token_ids), "max_tokens": self.max_tokens,
                "text": self.text}


@dataclass
class PromptSet:
    workload: "Workload"
    prompts: list[Prompt]
    stats: dict[str, Any] = field(default_factory=dict)  # workload-specific facts (shared prefix...)

    @property
    def name(self) -> str:
        return self.workload.name

    def fingerprint(self) -> str:
        return fingerprint(self.prompts)

    def to_json(self) -> dict[str, Any]:
        lengths = [len(p.token_ids) for p in self.prompts]
        return {"name": self.name, "describe": self.workload.describe,
                "num_prompts": len(self.prompts),
                "prompt_tokens": {"total": sum(lengths), "min": min(lengths, default=0),
                                  "max": max(lengths, default=0),
                                  "mean": sum(lengths) / len(lengths) if lengths else 0.0},
                "fingerprint": self.fingerprint(), **self.stats}


def fingerprint(prompts: Iterable[Prompt]) -> str:
    """SHA-256 of the prompts' token ids and output budgets (first 16 hex digits)."""
    data = json.dumps([[list(p.token_ids), p.max_tokens] for p in prompts], separators=(",", ":"))
    return hashlib.sha256(data.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class BuildContext:
    tokenizer: Tokenizer
    num_prompts: int
    max_tokens: int
    max_model_len: int
    seed: int
    stdlib: Path

    def rng(self, name: str, *extra: Any) -> random.Random:
        # String seeds are hashed with SHA-512 by `random`: stable across runs and machines.
        return random.Random(":".join(map(str, ("vllm-graft-bench", name, self.seed, *extra))))

    @property
    def prompt_budget(self) -> int:
        """The longest prompt that leaves room for ``max_tokens`` (+1 for scoring)."""
        return self.max_model_len - self.max_tokens - 1

    def make(self, workload: str, index: int, ids: Sequence[int], source: str,
             group: int | None = None, text: str | None = None) -> Prompt:
        ids = tuple(ids)
        if not ids:
            raise WorkloadError(f"{workload}: prompt {index} ({source}) is empty")
        budget = min(self.max_tokens, self.max_model_len - len(ids) - 1)
        if budget < 1:
            raise WorkloadError(f"{workload}: prompt {index} ({source}) has {len(ids)} tokens, "
                                f"no room for output in max_model_len {self.max_model_len}")
        return Prompt(workload, index, ids, self.tokenizer.decode(ids) if text is None else text,
                      budget, source, group)


@dataclass(frozen=True)
class Workload:
    name: str
    summary: str  # one line
    describe: str  # what it models and how it is built
    build: Callable[[BuildContext], tuple[list[Prompt], dict[str, Any]]]


# ------------------------------------------------------------------- stdlib sources
def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[str]:
    """POSIX paths (relative to ``root``) of the stdlib's ``.py`` files, sorted, tests excluded."""
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS)
        rel = Path(folder).relative_to(root)
        out += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    if not out:
        raise WorkloadError(f"no Python sources found in the standard library folder {root}")
    return sorted(out)


def _read(root: Path, rel: str) -> str:
    data = (root / rel).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


@dataclass(frozen=True)
class FunctionHead:
    path: str
    qualname: str
    head: str  # decorators, signature, docstring and the first statement's first line (dedented)
    source: str  # the whole function (dedented)


def function_heads(root: Path, rel: str) -> list[FunctionHead]:
    """The functions of one stdlib file that have a body to complete (at least two
    statements besides a docstring), in source order."""
    text = _read(root, rel)
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    out: list[FunctionHead] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qual = prefix + child.name
                body = list(child.body)
                doc = (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                       and isinstance(body[0].value.value, str))
                rest = body[1:] if doc else body
                if len(rest) >= 2 and child.end_lineno is not None:
                    start = min([child.lineno] + [d.lineno for d in child.decorator_list])
                    cut = rest[0].lineno  # up to and including the first statement's first line
                    if rest[0].lineno > (body[0].end_lineno or 0) or not doc:
                        head = textwrap.dedent("\n".join(lines[start - 1:cut])).rstrip()
                        whole = textwrap.dedent("\n".join(lines[start - 1:child.end_lineno])).rstrip()
                        if head and not head.endswith("\\"):
                            out.append(FunctionHead(rel, qual, head, whole))
                visit(child, qual + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")

    visit(tree, "")
    return out


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
        prompts.append(ctx.make("chat", i, ctx.tokenizer.encode(text), f"question {q}, format {f}",
                                text=text))
    return prompts, {}


SYSTEM_PROMPT = '''"""You are a careful Python assistant working on the standard library.

Answer every task with one function in the style of the examples below: a short
docstring that says what the function returns, standard-library imports only,
no global state, and clear names. Keep functions short; prefer early returns.
"""

'''


def _functions(ctx: BuildContext, name: str, files: list[str], *extra: Any) -> Iterable[FunctionHead]:
    """Function heads from the stdlib, one per file, files in a seeded order."""
    rng = ctx.rng(name, *extra)
    order = list(files)
    rng.shuffle(order)
    for rel in order:
        heads = function_heads(ctx.stdlib, rel)
        if heads:
            yield rng.choice(heads)


def _shared_prefix(ctx: BuildContext) -> tuple[list[Prompt], dict[str, Any]]:
    tok = ctx.tokenizer
    files = stdlib_files(ctx.stdlib)
    question_budget = 160
    prefix_target = min(SHARED_PREFIX_TOKENS, ctx.prompt_budget - question_budget)
    if prefix_target < 64:
        raise WorkloadError(f"shared-prefix: max_tokens {ctx.max_tokens} leaves too little room "
                            f"for a shared prefix in max_model_len {ctx.max_model_len}")
    questions = (h for h in _functions(ctx, "shared-prefix", files, "questions")
                 if len(tok.encode(h.head)) <= question_budget - 8)
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
            prompts.append(ctx.make("shared-prefix", len(prompts), ids, f"{q.path}:{q.qualname}",
                                    group=g, text=text))
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


def _stdlib_windows(tok: Tokenizer, root: Path, rng: random.Random,
                    length: int) -> Iterable[tuple[list[int], str]]:
    """Windows of exactly ``length`` token ids of stdlib source with their ``file@offset``:
    files long enough (~3.5 bytes per token on this code) in a seeded order, each window
    starting at a line boundary chosen by ``rng`` that leaves ~6 characters per token after it."""
    files = [f for f in stdlib_files(root) if (root / f).stat().st_size >= 5 * length]
    rng.shuffle(files)
    for rel in files:
        text = _read(root, rel)
        starts = [0]
        for line in text.splitlines(keepends=True):
            starts.append(starts[-1] + len(line))
        usable = [s for s in starts if len(text) - s >= 6 * length]
        if not usable:
            continue
        start = rng.choice(usable)
        ids = tok.encode(text[start:start + 8 * length])
        if len(ids) >= length:
            yield ids[:length], f"{rel}@{start}"


def _long_context(ctx: BuildContext) -> tuple[list[Prompt], dict[str, Any]]:
    tok = ctx.tokenizer
    length = min(LONG_CONTEXT_TOKENS, ctx.prompt_budget)
    if length < 256:
        raise WorkloadError(f"long-context: max_tokens {ctx.max_tokens} leaves only {length} prompt "
                            f"tokens in max_model_len {ctx.max_model_len} (needs at least 256)")
    root = ctx.stdlib
    windows = itertools.islice(_stdlib_windows(tok, root, ctx.rng("long-context"), length), ctx.num_prompts)
    prompts = [ctx.make("long-context", i, ids, source) for i, (ids, source) in enumerate(windows)]
    if len(prompts) < ctx.num_prompts:
        raise WorkloadError(f"long-context: only {len(prompts)} stdlib files in {root} are long "
                            f"enough for {length}-token prompts; {ctx.num_prompts} asked")
    return prompts, {"prompt_tokens_target": length}


def _code_completion(ctx: BuildContext) -> tuple[list[Prompt], dict[str, Any]]:
    tok = ctx.tokenizer
    limit = min(CODE_COMPLETION_MAX_TOKENS, ctx.prompt_budget)
    prompts = []
    for head in _functions(ctx, "code-completion", stdlib_files(ctx.stdlib)):
        if len(prompts) == ctx.num_prompts:
            break
        ids = tok.encode(head.head)
        if len(ids) > limit:
            continue
        prompts.append(ctx.make("code-completion", len(prompts), ids, f"{head.path}:{head.qualname}",
                                text=head.head))
    if len(prompts) < ctx.num_prompts:
        raise WorkloadError(f"code-completion: only {len(prompts)} functions found in {ctx.stdlib}")
    return prompts, {}


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload(
        "chat", "short chat-style prompts (10-40 tokens)",
        "Short chat-style prompts: a question about everyday Python (32 in code) in one of five "
        "conversation formats ('User: ...\\nAssistant:', 'Q: ...\\nA:', a one-turn greeting first, "
        "...); question x format pairs in a seeded order. Decode-dominated, small batch of short "
        "contexts.",
        _chat),
    Workload(
        "shared-prefix", f"groups of {SHARED_PREFIX_GROUP} requests sharing a ~{SHARED_PREFIX_TOKENS}-token prefix",
        f"Requests in groups of {SHARED_PREFIX_GROUP} that share a long common prefix: a system prompt "
        f"(a docstring of instructions) and few-shot examples (whole stdlib functions of at most 40 "
        f"lines) up to ~{SHARED_PREFIX_TOKENS} tokens, then a different task each: the head of "
        "another stdlib function. Each group has its own examples. What prefix caching and "
        "shared-prefix attention (Hydragen) are for.",
        _shared_prefix),
    Workload(
        "long-context", f"~{LONG_CONTEXT_TOKENS}-token Python source windows, continued",
        f"Code continuation at long context: {LONG_CONTEXT_TOKENS} tokens of a stdlib .py file "
        "(a seeded file among those long enough, from a seeded line), shortened so that prompt + "
        "output fit max_model_len. Prefill-heavy; decode attends over ~2K tokens: what KV "
        "compression and sparse attention are for.",
        _long_context),
    Workload(
        "code-completion", "heads of stdlib functions (signature, docstring, first line)",
        "Code completion: the beginning of a function from the standard library sources of the "
        "running interpreter (decorators, signature, docstring and the first statement's first "
        "line, dedented; functions with at least two statements after the docstring), one function "
        "per file, files and functions in a seeded order. Repetitive code: what n-gram and suffix "
        "speculation are for.",
        _code_completion),
)}


def parse_names(values: Sequence[str] | None) -> list[str]:
    """``--workload`` values (repeatable, each a comma list) -> workload names in the given
    order, duplicates dropped; none given -> all. Raises :class:`UnknownWorkloadError`."""
    if not values:
        return list(WORKLOADS)
    names: list[str] = []
    for value in values:
        for part in value.split(","):
            part = part.strip()
            if part == "all":
                names += [n for n in WORKLOADS if n not in names]
            elif part and part not in names:
                names.append(part)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise UnknownWorkloadError(unknown)
    if not names:
        raise WorkloadError(f"no workload named; accepted: {', '.join(WORKLOADS)}")
    return names


def build(names: Sequence[str], tokenizer: Tokenizer, *, num_prompts: int, max_tokens: int,
          max_model_len: int, seed: int = 0, stdlib: str | os.PathLike[str] | None = None) -> list[PromptSet]:
    """The prompt sets of the named workloads (deterministic in all arguments)."""
    if num_prompts < 1:
        raise WorkloadError(f"num_prompts must be at least 1 (got {num_prompts})")
    if max_tokens < 1 or max_tokens > max_model_len - 2:
        raise WorkloadError(f"max_tokens must be between 1 and {max_model_len - 2} for "
                            f"max_model_len {max_model_len} (got {max_tokens})")
    ctx = BuildContext(tokenizer, num_prompts, max_tokens, max_model_len, seed,
                       Path(stdlib) if stdlib is not None else stdlib_dir())
    out = []
    for name in parse_names(names):
        workload = WORKLOADS[name]
        prompts, stats = workload.build(ctx)
        assert len(prompts) == num_prompts, (name, len(prompts))
        out.append(PromptSet(workload, prompts, stats))
    return out


# ------------------------------------------------------- extractive (repetitive) workload
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
        text = fn.source.rstrip() + "\n\n\n# The same function again, unchanged:\n" + \
            "\n".join(lines[:first + 1]) + "\n"
        ids = tok.encode(text)
        if len(ids) > ctx.prompt_budget:
            continue
        prompts.append(ctx.make("extractive", len(prompts), ids, f"{fn.path}:{fn.qualname}", text=text))
    if len(prompts) < ctx.num_prompts:
        raise WorkloadError(f"extractive: only {len(prompts)} short functions found in {ctx.stdlib}")
    return prompts, {}


WORKLOADS["extractive"] = Workload(
    "extractive", "a stdlib function, then a request to write it again (copying)",
    "Extractive / repetitive: a whole function from the standard library (4 to "
    f"{EXTRACTIVE_MAX_LINES} lines, one per file, seeded order), then '# The same function "
    "again, unchanged:' and its signature line: the fitting continuation copies the prompt. "
    "What prompt-lookup, trie (Lookahead) and n-gram speculation are for.",
    _extractive)


# ------------------------------------------------------------ KV compression: long texts
@dataclass(frozen=True)
class Needle:
    """One needle-in-a-haystack retrieval prompt: ``token_ids`` ends where the model must
    copy ``answer_ids`` (exact match: the greedy output starts with them)."""

    token_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]
    depth: float  # where the needle sits in the haystack (0 = start, 1 = end)
    source: str


def stdlib_texts(tokenizer: Tokenizer, *, num: int, tokens: int, seed: int = 0,
                 root: Path | None = None) -> list[tuple[tuple[int, ...], str]]:
    """``num`` windows of exactly ``tokens`` token ids of stdlib source (seeded choice of
    files long enough, starting at a line boundary), with their source ``file@offset``."""
    root = root or stdlib_dir()
    rng = random.Random(f"vllm-graft-kv-texts:{seed}:{tokens}")
    windows = itertools.islice(_stdlib_windows(tokenizer, root, rng, tokens), num)
    out = [(tuple(ids), source) for ids, source in windows]
    if len(out) < num:
        raise WorkloadError(f"only {len(out)} stdlib files are long enough for {tokens}-token texts")
    return out


def needle_haystack(tokenizer: Tokenizer, *, num_prompts: int, context_tokens: int, seed: int = 0,
                    root: Path | None = None) -> list[Needle]:
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
        prompt = tokenizer.encode(text)[-(context_tokens - 1):]
        full = tokenizer.encode(text + value + '"')
        answer = full[len(tokenizer.encode(text)):]
        if not answer or tokenizer.encode(text) + answer != full:
            answer = tokenizer.encode(value + '"')  # the tokenizer merges across the boundary
        out.append(Needle(tuple(prompt), tuple(answer), round(depth, 3), source))
    return out


# ------------------------------------------------ long-range recall (retrieval) workload
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
        raise WorkloadError(f"long-recall: max_tokens {ctx.max_tokens} leaves only {length} prompt "
                            f"tokens in max_model_len {ctx.max_model_len} (needs at least {4 * lo})")
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
        fns = sorted((n.lineno, n.end_lineno) for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.decorator_list
                     and n.end_lineno is not None and n.lineno > 8)
        rng.shuffle(fns)
        for first, last in fns[:12]:
            repeat = text[starts[first - 1]:starts[last]]
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
                if len(tok.encode(text[begin:ends[mid]])) <= room:
                    lo_k = mid
                else:
                    hi_k = mid - 1
            filler = tok.encode(text[begin:ends[lo_k]])
            ids = filler + rep
            r = len(filler)
            # The first copy, token for token, inside the filler.
            o = next((i for i in range(len(filler) - len(rep) + 1) if filler[i:i + len(rep)] == rep), None)
            if o is None or o < LONG_RECALL_LEAD or r - o < len(ids) // 2 or len(ids) < length - 64:
                continue
            prompts.append(ctx.make("long-recall", len(prompts), ids, f"{rel}:{first}-{last}@{begin}"))
            spans.append([r, len(ids)])
            distances.append(r - o)
            break
    if len(prompts) < ctx.num_prompts:
        raise WorkloadError(f"long-recall: only {len(prompts)} stdlib files in {root} give a "
                            f"{length}-token window with a repeatable function; {ctx.num_prompts} asked")
    return prompts, {"prompt_tokens_target": length, "scored_spans": spans, "recall_distance": distances}


WORKLOADS["long-recall"] = Workload(
    "long-recall", f"~{LONG_CONTEXT_TOKENS}-token source windows ending with a repeat of an early function",
    f"Long-range recall at long context: a ~{LONG_CONTEXT_TOKENS}-token window of a stdlib .py file "
    "(seeded file) starting 6-20 lines before a function (no decorators, "
    f"{LONG_RECALL_SPAN[0]}-{LONG_RECALL_SPAN[1]} tokens), whole lines of the file after it, then "
    "that function again token for token as the last tokens of the prompt. Its first copy lies "
    "at least half the prompt back, so a recent window cannot see it: predicting the repeat "
    "needs retrieval from the middle of the context (what sparse attention must keep). The "
    "stats name each prompt's repeated span (scored_spans) and the distance to its first copy.",
    _long_recall)
