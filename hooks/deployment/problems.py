"""Validation problems: each names the field path, the value found and what is accepted."""

from __future__ import annotations

import difflib
import typing
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel, ValidationError


_MISSING = object()


# ---------------------------------------------------------------------------- problems
@dataclass
class Problem:
    """One thing wrong with a deployment."""

    path: str
    message: str
    value: Any = _MISSING
    accepted: str | None = None
    hint: str | None = None

    @property
    def has_value(self) -> bool:
        return self.value is not _MISSING

    def __str__(self) -> str:
        text = f"{self.path}: {self.message}"
        if self.has_value:
            text += f" (got {_show(self.value)})"
        if self.accepted:
            text += f"; accepted: {self.accepted}"
        if self.hint:
            text += f". {self.hint}"
        return text


class DeploymentError(ValueError):
    """A deployment that cannot be used; ``problems`` lists every issue found."""

    def __init__(self, problems: list[Problem], source: str = "deployment") -> None:
        self.problems = problems
        self.source = source
        n = len(problems)
        lines = [f"{source}: {n} problem{'s' if n != 1 else ''}:"]
        lines += [f"  - {p}" for p in problems]
        super().__init__("\n".join(lines))


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def did_you_mean(word: Any, options: list[str]) -> str | None:
    if not isinstance(word, str):
        return None
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f"Did you mean {close[0]!r}?" if close else None


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _is_model(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseModel)


def _unwrap_model(annotation: Any) -> Any:
    """The BaseModel inside an annotation such as ``X | None`` or ``list[X]`` (or None)."""
    if _is_model(annotation):
        return annotation
    for arg in typing.get_args(annotation):
        found = _unwrap_model(arg)
        if found is not None:
            return found
    return None


def _submodel(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class found at ``loc`` (list indices skipped) inside ``model``, or None."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        f = current.model_fields.get(part) if _is_model(current) else None
        if f is None:
            return None
        current = _unwrap_model(f.annotation)
    return current if _is_model(current) else None


Loc = tuple[Any, ...]


def pydantic_problems(
    exc: ValidationError,
    model: type[BaseModel],
    prefix: Loc = (),
    *,
    as_written: Callable[[Loc], Loc] = lambda loc: loc,
    missing_accepted: Callable[[Loc], str | None] = lambda loc: None,
) -> list[Problem]:
    """Turn pydantic's errors into problems that name path, value and what is accepted.

    ``as_written`` maps a validated location back to where the user wrote it;
    ``missing_accepted`` says what a missing field accepts where its description can't.
    """
    problems = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        path = _path(prefix + as_written(loc))
        if err["type"] == "extra_forbidden":
            parent = _submodel(model, loc[:-1])
            accepted = list(parent.model_fields) if parent is not None else []
            problems.append(
                Problem(
                    path,
                    "unknown field",
                    accepted=", ".join(accepted) or "no fields at all",
                    hint=did_you_mean(loc[-1], accepted),
                )
            )
        elif err["type"] == "missing":
            problems.append(
                Problem(
                    path, "required field is missing", accepted=missing_accepted(loc) or _field_description(model, loc)
                )
            )
        else:
            msg = err["msg"]
            msg = msg[len("Value error, ") :] if msg.startswith("Value error, ") else msg
            desc = _field_description(model, loc)
            problems.append(Problem(path, msg, value=err.get("input", _MISSING), accepted=desc))
    return problems


def _field_description(model: type[BaseModel], loc: tuple[Any, ...]) -> str | None:
    names = [p for p in loc if not isinstance(p, int)]
    parent = _submodel(model, tuple(names[:-1])) if names else None
    f = parent.model_fields.get(names[-1]) if parent is not None else None
    return f.description if f is not None else None
