"""Hook specifications of vllm-graft: the whole extension API.

A plugin is a module (or object) with functions marked ``@hookimpl`` whose names are
the hooks below. Each hook is called exactly once at start-up with a ``register``
callback; call it once per plugin you provide, with a
:class:`~vllm_graft.hooks.registry.Registration`. The hook fills in the registration's
``kind``; giving a different kind is an error.

Hooks never run per token or per layer: the calls build a plain
:class:`~vllm_graft.hooks.registry.Registry` that the hot path reads.

Make a plugin findable by listing its module in the ``vllm_graft`` entry-point group of
its distribution::

    [project.entry-points.vllm_graft]
    my-plugin = "my_package.my_module"
"""

from __future__ import annotations

from typing import Callable

import pluggy

from .registry import Registration

PROJECT = "vllm_graft"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[[Registration], None]


# -------------------------------------------------------------------------------------
# Attention backends
# -------------------------------------------------------------------------------------


@hookspec
def graft_register_attention(register: Register) -> None:
    """Register attention methods.

    :param register: call ``register(Registration(...))`` once per attention method.
        ``impl`` names a class implementing
        :class:`~vllm_graft.hooks.contracts.AttentionMethod`.

    vLLM runs a registered method as its attention backend (an override of CPU_ATTN on
    CPU, the CUSTOM backend on GPU). Declare the head sizes and dtypes the kernel
    supports in ``capabilities``.

    Example::

        @hookimpl
        def graft_register_attention(register):
            register(Registration(
                name="my-attn", summary="...", paper="...",
                impl="my_pkg.attn:MyAttention",
                capabilities=Capabilities(lossless=True, head_sizes=(64, 128)),
            ))
    """


# -------------------------------------------------------------------------------------
# KV-cache compressors
# -------------------------------------------------------------------------------------


@hookspec
def graft_register_kv_compressors(register: Register) -> None:
    """Register KV-cache compressors (eviction policies, KV quantisers).

    :param register: call ``register(Registration(...))`` once per compressor.
        ``impl`` names a class implementing
        :class:`~vllm_graft.hooks.contracts.KVCompressor`.

    Example::

        @hookimpl
        def graft_register_kv_compressors(register):
            register(Registration(
                name="my-evict", summary="...", paper="...", params=MyParams,
                impl="my_pkg.evict:MyEvict", capabilities=Capabilities(lossless=False),
            ))
    """


# -------------------------------------------------------------------------------------
# Speculative-decoding proposers
# -------------------------------------------------------------------------------------


@hookspec
def graft_register_spec_proposers(register: Register) -> None:
    """Register speculative-decoding proposers (draft-token generators).

    :param register: call ``register(Registration(...))`` once per proposer.
        ``impl`` names a class implementing
        :class:`~vllm_graft.hooks.contracts.Proposer`.

    vLLM verifies the drafted tokens, so a proposer never changes greedy outputs:
    declare ``lossless=True``.

    Example::

        @hookimpl
        def graft_register_spec_proposers(register):
            register(Registration(
                name="my-drafter", summary="...", paper="...",
                impl="my_pkg.draft:MyDrafter", capabilities=Capabilities(lossless=True),
            ))
    """


# -------------------------------------------------------------------------------------
# Quantization methods
# -------------------------------------------------------------------------------------


@hookspec
def graft_register_quant_methods(register: Register) -> None:
    """Register weight quantization methods.

    :param register: call ``register(Registration(...))`` once per method.
        ``impl`` names a class implementing
        :class:`~vllm_graft.hooks.contracts.QuantMethod`.

    Example::

        @hookimpl
        def graft_register_quant_methods(register):
            register(Registration(
                name="my-q4", summary="...", paper="...", params=MyQ4Params,
                impl="my_pkg.q4:MyQ4", capabilities=Capabilities(lossless=False),
            ))
    """


# -------------------------------------------------------------------------------------
# MoE schedulers
# -------------------------------------------------------------------------------------


@hookspec
def graft_register_moe_schedulers(register: Register) -> None:
    """Register MoE schedulers (routing changes, expert placement, expert caching).

    :param register: call ``register(Registration(...))`` once per scheduler.
        ``impl`` names a class implementing
        :class:`~vllm_graft.hooks.contracts.MoEScheduler`.

    Restrict ``capabilities.architectures`` to the MoE architectures you handle
    (e.g. ``("MixtralForCausalLM",)``) so a deployment on a dense model is refused.

    Example::

        @hookimpl
        def graft_register_moe_schedulers(register):
            register(Registration(
                name="my-router", summary="...", paper="...",
                impl="my_pkg.route:MyRouter",
                capabilities=Capabilities(lossless=False, architectures=("MixtralForCausalLM",)),
            ))
    """
