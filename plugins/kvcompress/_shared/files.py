"""The calibrated files KV storage formats read (``million``'s codebooks, ``xquant``'s bases):
safetensors files whose string metadata says what they hold, read without torch so that
deployment validation can check a file against the model's config."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def safetensors_metadata(path: str | Path) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file's header; FileNotFoundError if there is no
    file, ValueError (naming the cause) if it is not a safetensors file."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 1 << 26:
                raise ValueError("header too large")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise
    except (OSError, ValueError, struct.error) as e:
        raise ValueError(str(e)) from None
    return header.get("__metadata__") or {}


def read_format_header(
    path: str | Path, *, what: str, fmt: str, calibrate: str, error: type[ValueError]
) -> dict[str, str]:
    """The metadata of a calibrated file of format ``fmt`` (``what`` names it in messages, such as
    "xquant bases file"), read without torch; ``error`` naming the fix (``calibrate``) if there
    is no file, it is no safetensors file, or it is one of another format."""
    p = Path(path)
    try:
        meta = safetensors_metadata(p)
    except FileNotFoundError:
        raise error(f"{what} {str(p)!r} does not exist; write it with `{calibrate}`") from None
    except ValueError as e:
        raise error(f"{what} {str(p)!r} is not a safetensors file ({e}); write it with `{calibrate}`") from None
    if meta.get("format") != fmt:
        raise error(
            f"{str(p)!r} is not a {what} (format {meta.get('format')!r}, expected {fmt!r}); "
            f"write one with `{calibrate}`"
        )
    return meta


def model_mismatch(meta: dict[str, str], path: str, *, what: str, fix: str, **want: int | None) -> str | None:
    """Why a calibrated file (its header ``meta``) was made for another model than the one whose
    ``num_layers`` / ``num_kv_heads`` / ``head_size`` are given (None: not checked), or None."""
    wrong = [
        f"{key.replace('_', ' ')} {value}"
        for key, value in want.items()
        if value is not None and int(meta.get(key, -1)) != value
    ]
    if not wrong:
        return None
    made = (
        f"made for {meta.get('model', '?')} ({meta.get('num_layers')} layers, {meta.get('num_kv_heads')} KV "
        f"heads, head size {meta.get('head_size')})"
    )
    return f"{what} {path!r} was {made}, but this model has {', '.join(wrong)}: {fix}"
