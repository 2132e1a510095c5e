"""Package discovery for the folder-to-package mapping declared in pyproject.toml.

Every sub-folder of hooks/, plugins/, integration/, kit/ and tools/ that has an ``__init__.py``
becomes a sub-package of ``vllm_graft.<folder>``, so adding a plugin folder needs
no edit of the packaging files.
"""
from setuptools import find_packages, setup

ROOTS = ("hooks", "plugins", "integration", "kit", "tools")

packages = []
for root in ROOTS:
    packages.append(f"vllm_graft.{root}")
    packages += [f"vllm_graft.{root}.{sub}" for sub in find_packages(root)]

setup(packages=packages)
