"""What the measurement tools' command lines share: a sub-command registered with its handler
and its module docstring's paragraphs as description (:func:`tool_parser`), a repeatable
comma-list option with a default (:class:`CommaLists`, :func:`add_comma_list`), a tool's options
dataclass filled from the same-named arguments (:func:`from_args`), and writing a result to the
``--json FILE`` a tool was given (:func:`write_json`). No vLLM, no plugin: the CLI imports every
tool's ``add_command`` at start-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence, TypeVar

T = TypeVar("T")


def tool_parser(
    sub: Any, name: str, help: str, func: Any, doc: str | None, paragraphs: slice = slice(1, None), **kw: Any
) -> argparse.ArgumentParser:
    """Sub-command ``name`` of ``sub`` (``add_subparsers()``) run by ``func(args, console)``,
    its description those ``paragraphs`` of the tool module's docstring ``doc`` (by default all
    past the first, the module's title); ``kw`` go to ``add_parser`` (``formatter_class``)."""
    description = "\n\n".join(doc.split("\n\n")[paragraphs]) if doc else None
    p = sub.add_parser(name, help=help, description=description, **kw)
    p.set_defaults(func=func)
    return p


class CommaLists(argparse.Action):
    """A repeatable comma list, ``--x A,B --x C``: ``["A,B", "C"]``, as given (the tool splits
    them); its default (a list of the same form) stands only where the option is not given, where
    argparse's ``append`` would add the values to it."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        got = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, [*([] if got is None or got is self.default else got), values])


def add_comma_list(p: Any, flag: str, default: Sequence[str], note: str = "") -> None:
    """Option ``flag``, a repeatable comma list (:class:`CommaLists`) defaulting to ``default``
    joined, its help ``comma list (default: A,B)`` and the ``note``."""
    joined = ",".join(default)
    p.add_argument(flag, action=CommaLists, default=[joined], help=f"comma list (default: {joined}){note}")


def from_args(cls: type[T], args: Any, **given: Any) -> T:
    """The dataclass ``cls`` (a tool's options) from its command line ``args`` (the parsed
    namespace): each field not ``given`` from the argument of the same name (``--kv-blocks``:
    ``kv_blocks``); a field no argument names keeps its default."""
    names = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in given]  # type: ignore[arg-type]
    return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)}, **given)


def write_json(path: str | Path | None, value: Any, **kw: Any) -> None:
    """``value`` as indented JSON to ``path`` (a tool's ``--json FILE``); ``None``: nothing written.
    ``kw`` go to :func:`json.dumps` (``default=str`` for paths and the like)."""
    if path:
        Path(path).write_text(json.dumps(value, indent=1, **kw) + "\n")
