"""A plugin method that raises inside vLLM's engine step: the error names the plugin, the method
and the rule it broke. vLLM-free.

vLLM cannot fail one request from inside a step: an exception in the scheduler or the worker's
forward ends the engine core (``EngineCore encountered a fatal error``, then ``EngineDeadError``
in the front end; in-process, ``LLM.generate`` raises it). So the adapters catch an exception a
plugin's hot-path method raises and raise :class:`PluginRaised` from it, whose message the
engine core logs and the front end shows. Zero cost when nothing raises (Python's try blocks)
and nothing here touches tensors, so it is safe in code a CUDA graph replays.
"""

from __future__ import annotations


class PluginRaised(RuntimeError):
    """A plugin's method raised inside vLLM's engine step (the original is its ``__cause__``)."""


def raised(kind: str, plugin: str, method: str, err: BaseException) -> PluginRaised:
    """The error to raise ``from err`` when ``plugin``'s ``method`` raised ``err``."""
    return PluginRaised(
        f"{kind} plugin {plugin!r}: {method} raised {type(err).__name__}: {err}. {method} runs inside "
        "vLLM's engine step, where vLLM cannot fail a single request, so the engine stops; a plugin's "
        "hot-path methods must not raise. Fix the plugin, or leave it out of the deployment"
    )


__all__ = ["PluginRaised", "raised"]
