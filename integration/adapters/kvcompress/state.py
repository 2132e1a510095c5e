"""The kvcompress adapter's process state, vLLM-free: the compressor (and storage format) a
deployment activated in this process (:func:`get_active`; it lives on the process's runtime, in
the adapter's :class:`KVCompressState`, set by its ``activate`` and cleared by deactivation), and
the adapter's patch owner and supported vLLM range."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from ....hooks.registry import SUPPORTED_VLLM
from ....hooks import Kind, KVCacheFormat, KVCompressor
from ... import targets
from .plan import KVCompressError
from ...runtime import RUNTIME

OWNER = targets.KVCOMPRESS
VERSIONS = SUPPORTED_VLLM  # the adapter was written and checked against this range


@dataclass
class Active:
    """What a deployment's ``activate`` set up in this process (see :func:`get_active`)."""

    compressor: KVCompressor
    name: str
    count: Callable[[str, int], None]
    salt: str | None = None  # prefix-cache salt of this compressor and budget (None: lossless)
    #: each request gets a salt of its own (a ``merges`` compressor: merged blocks match no hash)
    salt_per_request: bool = False
    scored: Any = None  # worker-side state of a needs_scores compressor (a scores._Scores)
    needs_scores: bool = False
    to_free: dict = field(default_factory=dict)  # scheduler side: request id -> logical blocks the worker dropped
    # rule-based compressors (see "The frees check" in the package doc): the scheduler's blocks
    # freed in this schedule() (request id -> {block size: [logical blocks]}), and in the worker
    # every block the scheduler freed per request and block size, which its skips must contain
    freed_now: dict = field(default_factory=dict)
    worker_freed: dict = field(default_factory=dict)
    kv_format: KVCacheFormat | None = None  # the storage format (e.g. kv4), if one is enabled
    format_name: str = ""

    @property
    def spec_name(self) -> str:
        """What the KV-cache spec records: the compressor, then the storage format."""
        if self.kv_format is None or self.format_name == self.name:
            return self.name
        return f"{self.name}+{self.format_name}"


@dataclass
class KVCompressState:
    """The kvcompress adapter's per-deployment state (``KVCompressAdapter.State``, on the runtime)."""

    active: Active | None = None


def get_active() -> Active | None:
    """The active compressor of this process (None: no deployment with a kvcompress plugin)."""
    state = RUNTIME.adapter_state.get(Kind.KVCOMPRESS)  # reading makes no state
    return None if state is None else state.active


def set_active(active: Active | None) -> None:
    """Make ``active`` this process's (the adapter's ``activate``; deactivation clears it)."""
    RUNTIME.kind_state(Kind.KVCOMPRESS, KVCompressState).active = active


def current(spec_compressor: str) -> Active:
    """The active state, for a KV cache whose spec names ``spec_compressor``; raises
    :class:`KVCompressError` if none is active, or another one."""
    active = get_active()
    if active is None:
        raise KVCompressError(
            f"a vllm-graft KV-compression cache (plugin {spec_compressor!r}) is in use in process "
            f"{os.getpid()}, but no deployment with a kvcompress plugin is active there (was "
            "another engine with a different deployment started in this process?)"
        )
    if spec_compressor and spec_compressor != active.spec_name:
        raise KVCompressError(
            f"this engine's KV cache was built for kvcompress plugin {spec_compressor!r}, but "
            f"{active.spec_name!r} is active in this process"
        )
    return active
