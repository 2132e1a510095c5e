"""The text sources of the workloads: the ``.py`` files of the running interpreter's standard
library, the function heads in them, and token windows of them."""

from __future__ import annotations

import ast
import itertools
import os
import random
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from .base import BuildContext, Tokenizer, WorkloadError

#: Folder names skipped when walking the stdlib (the test suites and third-party packages),
#: as in the models' training corpus (models/corpus.py).
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


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
                doc = (
                    body
                    and isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)
                )
                rest = body[1:] if doc else body
                if len(rest) >= 2 and child.end_lineno is not None:
                    start = min([child.lineno] + [d.lineno for d in child.decorator_list])
                    cut = rest[0].lineno  # up to and including the first statement's first line
                    if rest[0].lineno > (body[0].end_lineno or 0) or not doc:
                        head = textwrap.dedent("\n".join(lines[start - 1 : cut])).rstrip()
                        whole = textwrap.dedent("\n".join(lines[start - 1 : child.end_lineno])).rstrip()
                        if head and not head.endswith("\\"):
                            out.append(FunctionHead(rel, qual, head, whole))
                visit(child, qual + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")

    visit(tree, "")
    return out


def _functions(ctx: BuildContext, name: str, files: list[str], *extra: Any) -> Iterable[FunctionHead]:
    """Function heads from the stdlib, one per file, files in a seeded order."""
    rng = ctx.rng(name, *extra)
    order = list(files)
    rng.shuffle(order)
    for rel in order:
        heads = function_heads(ctx.stdlib, rel)
        if heads:
            yield rng.choice(heads)


def _stdlib_windows(tok: Tokenizer, root: Path, rng: random.Random, length: int) -> Iterable[tuple[list[int], str]]:
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
        ids = tok.encode(text[start : start + 8 * length])
        if len(ids) >= length:
            yield ids[:length], f"{rel}@{start}"


def stdlib_texts(
    tokenizer: Tokenizer, *, num: int, tokens: int, seed: int = 0, root: Path | None = None
) -> list[tuple[tuple[int, ...], str]]:
    """``num`` windows of exactly ``tokens`` token ids of stdlib source (seeded choice of
    files long enough, starting at a line boundary), with their source ``file@offset``."""
    root = root or stdlib_dir()
    rng = random.Random(f"vllm-graft-kv-texts:{seed}:{tokens}")
    windows = itertools.islice(_stdlib_windows(tokenizer, root, rng, tokens), num)
    out = [(tuple(ids), source) for ids, source in windows]
    if len(out) < num:
        raise WorkloadError(f"only {len(out)} stdlib files are long enough for {tokens}-token texts")
    return out
