"""hooks/versions.py is the one table of supported vLLM builds: the range, the extras and the
doctor's CUDA wheel all come from it."""
from __future__ import annotations

import importlib.metadata as md

from packaging.specifiers import SpecifierSet

from vllm_graft.hooks.versions import SUPPORTED_VLLM, VLLM_BUILDS, VLLMBuild, _supported, extras


def test_the_range_covers_every_build_and_nothing_past_the_last():
    spec = SpecifierSet(SUPPORTED_VLLM)
    for b in VLLM_BUILDS:
        assert b.checked in spec and b.checked.startswith(b.minor + ".")
    assert "0.31.9" not in spec and "0.34.0" not in spec
    assert _supported((VLLMBuild("0.33", "cuda", "vllm", "gpu", "0.33.1", "static"),)) == ">=0.33,<0.34"


def test_the_installed_package_extras_are_the_table():
    requires = md.requires("vllm-graft") or []
    for extra, reqs in extras().items():
        for r in reqs:
            assert f'{r}; extra == "{extra}"' in requires, f"{r} is not the [{extra}] extra; reinstall"
    assert extras() == {b.extra: [b.requirement, *(p.requirement for p in b.pins)] for b in VLLM_BUILDS}
