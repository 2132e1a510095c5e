"""pytest plugin of the conformance kit (entry point ``pytest11: vllm_graft``).

Inert unless a test requests the ``graft_check`` fixture: then, for every plugin its
``graft_conformance`` marker (or ``--graft-conformance``) names, the test runs once per
check of :data:`~vllm_graft.kit.conformance.checks.CHECKS`. This module imports
nothing heavy: the registry is built only when such a test is collected.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

MARKER = "graft_conformance"
FIXTURE = "graft_check"


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("vllm-graft", "vllm-graft plugin conformance")
    group.addoption(
        "--graft-conformance",
        action="append",
        default=[],
        metavar="SPEC",
        help="also check this plugin: 'kind:name', 'builtin' or 'all' (repeatable); "
        "applies to tests that use the graft_check fixture",
    )
    group.addoption(
        "--graft-no-engine", action="store_true", help="skip the conformance checks that start a vLLM engine"
    )


def pytest_configure(config: Any) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(*specs, params=None): run the vllm-graft conformance checks on these plugins "
        "('kind:name', 'builtin', 'all') through the graft_check fixture",
    )
    config.addinivalue_line("markers", "e2e: starts a vLLM engine (the conformance 'engine' check)")


class _Case:
    def __init__(self, target: Any, check: Any) -> None:
        self.target, self.check = target, check

    def __repr__(self) -> str:
        return f"{self.target.spec}/{self.check.name}"


def pytest_generate_tests(metafunc: Any) -> None:
    if FIXTURE not in metafunc.fixturenames:
        return
    from .checks import CHECKS, Target, example_params, resolve_specs

    # Before any plugin kernel module is imported: Triton runs on the CPU's interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    specs: list[str] = list(metafunc.config.getoption("--graft-conformance"))
    params_override = None
    for mark in metafunc.definition.iter_markers(MARKER):
        specs += list(mark.args)
        params_override = mark.kwargs.get("params", params_override)
    if not specs:
        raise pytest.UsageError(
            f"{metafunc.definition.nodeid} uses {FIXTURE} but names no plugin: mark it "
            f"@pytest.mark.{MARKER}('kind:name') or pass --graft-conformance kind:name"
        )
    entries = resolve_specs(specs)
    if params_override is not None and len(entries) != 1:
        raise pytest.UsageError(f"{MARKER}(params=...) needs exactly one plugin, got {len(entries)}")
    cases = []
    for entry in entries:
        target = Target(entry, example_params(entry, params_override))
        for check in CHECKS:
            if check.kinds is not None and entry.kind not in check.kinds:
                continue
            marks = [pytest.mark.e2e] if check.engine else []
            cases.append(pytest.param(_Case(target, check), id=f"{target.spec}/{check.name}", marks=marks))
    metafunc.parametrize(FIXTURE, cases, indirect=True)


@pytest.fixture
def graft_check(request: Any):
    """A callable running one conformance check (see the kit's package docstring)."""
    from .base import Skipped

    case: _Case = request.param
    if case.check.engine and request.config.getoption("--graft-no-engine"):
        pytest.skip("--graft-no-engine")

    def run() -> str:
        try:
            summary = case.check.func(case.target)
        except Skipped as e:
            pytest.skip(str(e))
        print(f"{case!r}: {summary}")
        return summary

    return run
