"""What the measurement tools' command lines share: a sub-command's parser described by its
module's docstring, the options several tools take with one meaning, and writing a result to
the ``--json FILE`` a tool was given. No vLLM, no plugin: the CLI imports every tool's
``add_command`` at start-up.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | Path | None, value: Any, **kw: Any) -> None:
    """``value`` as indented JSON to ``path`` (a tool's ``--json FILE``); ``None``: nothing written.
    ``kw`` go to :func:`json.dumps` (``default=str`` for paths and the like)."""
    if path:
        Path(path).write_text(json.dumps(value, indent=1, **kw) + "\n")
