"""Loading a script of the repository's ``benchmarks/`` folder (not a package) in a test."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(relative: str) -> ModuleType:
    """``benchmarks/<relative>`` as a module named after its file, registered in ``sys.modules``
    (dataclasses and pickling look it up there), with its folder on ``sys.path`` (the scripts
    import their helpers, e.g. ``_timing``, from beside them)."""
    path = BENCHMARKS / relative
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(path.stem, module)
    spec.loader.exec_module(module)
    return module
