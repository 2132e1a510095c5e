"""What the tests share about what a machine builds and loads: a plugin's C++ CPU path, which
must build wherever a C++ compiler is installed; and the vLLM modules a fresh interpreter has
loaded after some code of the package."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest


def require_built(built: tuple, what: str) -> None:
    """``built``: a C++ path's (function or None, reason). None fails the test where a C++
    compiler is installed (``what`` did not build) and skips it where none is."""
    fn, reason = built
    if fn is None:
        if shutil.which("c++") or shutil.which("g++"):
            pytest.fail(f"a C++ compiler is installed but {what} did not build: {reason}")
        pytest.skip(f"no C++ compiler here: {reason}")


def vllm_loaded_by(code: str) -> str:
    """What a fresh interpreter prints after running ``code`` and then the sorted names of the
    vLLM modules loaded (``[]``: none): its whole output, stripped."""
    script = code + "\nimport sys\nprint(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.strip()
