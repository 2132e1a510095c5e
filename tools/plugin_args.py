"""Naming a registered plugin and its parameters on a measurement tool's command line.

Every tool that compares plugins of one kind (``kvbench``, ``kv-headroom``, ``specbench``,
``sparse-quality``, ``quant-eval``, ``moe-sim``) takes any plugin of that kind found in the
registry (built-in or installed by a third party through the ``vllm_graft`` entry points), by
name, with parameters given either for every named plugin (``--params JSON``) or per plugin
(``NAME:{JSON}`` in the tool's comma list; commas inside the braces do not split). The
parameters are validated by the plugin's own parameter model before any engine starts; an
unknown name is refused with the registered names of its kind.
"""

from __future__ import annotations

import json
from typing import Any


class PluginArgError(ValueError):
    """A plugin named on the command line is not registered, or its parameters are invalid."""


def split_list(text: str) -> list[str]:
    """Split a comma list at commas outside braces, brackets and quotes:
    ``'streaming,tova:{"a": 1, "b": 2}'`` -> ``['streaming', 'tova:{"a": 1, "b": 2}']``."""
    out: list[str] = []
    cur: list[str] = []
    depth, quote = 0, ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    out.append("".join(cur).strip())
    return [x for x in out if x]


def parse_json_params(text: str | None, where: str = "--params") -> dict[str, Any]:
    """A JSON object of parameters (``None`` or empty: ``{}``)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise PluginArgError(f"{where}: not JSON ({e.msg} at character {e.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise PluginArgError(f"{where}: expected a JSON object such as '{{\"budget_blocks\": 8}}', got {text!r}")
    return value


def parse_spec(item: str) -> tuple[str, dict[str, Any] | None]:
    """``NAME`` -> ``(NAME, None)``; ``NAME:{JSON}`` -> ``(NAME, the object)``."""
    name, sep, rest = item.partition(":")
    if not sep:
        return item.strip(), None
    return name.strip(), parse_json_params(rest.strip(), where=f"{name.strip()}:")


def registration(kind: str, name: str) -> Any:
    """The registration of plugin ``name`` of ``kind``; unknown: an error naming the registered
    plugins of that kind."""
    from ..hooks import get_registry

    reg = get_registry()
    if (kind, name) not in reg:
        known = [n for n in reg.names(kind) if n != "noop"]
        raise PluginArgError(
            f"no {kind} plugin named {name!r}; registered: {', '.join(known)} (see `vllm-graft plugins --kind {kind}`)"
        )
    return reg.get(kind, name).registration


def validate(kind: str, name: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` checked by plugin ``name``'s own parameter model; returns them unchanged (as
    given: the deployment validates them again), or raises :class:`PluginArgError` with the
    model's message."""
    from pydantic import ValidationError

    reg = registration(kind, name)
    try:
        reg.params(**params)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or '(model)'}: {err['msg']}" for err in e.errors())
        raise PluginArgError(f"{kind} plugin {name!r}: invalid parameters {json.dumps(params)}: {problems}") from None
    return params


def param_fields(kind: str, name: str) -> set[str]:
    """The parameter names plugin ``name`` accepts (its model's fields)."""
    return set(registration(kind, name).params.model_fields)
