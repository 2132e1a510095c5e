"""From a deployment to a validated plan: :func:`plan_for`, the one way every entry point takes.

A deployment comes as a YAML/JSON file, a dict, or vLLM's ``additional_config`` (a dict or
the JSON text of ``--additional-config``, with the deployment under ``"graft"``). Whatever its
form, :func:`plan_for` reads it, merges in what the engine being started says (its model, its
parallelism and dtype flags, the quant plugin a pre-quantised checkpoint implies), validates it
once against the registered plugins and the installed vLLM
(:func:`vllm_graft.hooks.validate`, the pure validation step; :func:`~vllm_graft.hooks.validate_file`
is that step for a file), and makes a local model path absolute.

Used by the command line (``check``, ``demo``, ``generate``, ``serve``, ``bench``, the
``doctor``), the tools, the conformance kit, and the bridge inside vLLM.

Validated once per process
--------------------------
An in-process engine (``vllm.LLM`` in the process that validated the plan: ``demo``,
``generate``, ``bench``, the tools) receives the plan as ``additional_config`` (its own JSON,
:func:`deployment_for_engine`), and vLLM's ``create_engine_config`` hands that back to the
bridge, which calls :func:`plan_for` with the engine's model. When the deployment it then asks
for is exactly the plan this process last validated (the same deployment JSON once the engine's
model and flags are merged in, the same environment and registry), :func:`plan_for` returns that
plan instead of validating it again. Every other
process vLLM starts (``serve``'s API server, the engine core and workers it spawns) is a new
interpreter that receives the deployment as text (``--additional-config`` or
``VLLM_GRAFT_CONFIG``) and validates it again: necessarily, since a plan is Python objects
(the plugins' parameter models, the registry's entries) that do not cross a process boundary.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..hooks import DeploymentError, Plan, Problem, get_registry, validate
from ..hooks.deployment import load_file, parse_json

from .env import detect_environment
from .runtime import RUNTIME

if TYPE_CHECKING:
    from .adapters import Adapter

#: The key of vLLM's ``additional_config`` that carries the deployment.
ADDITIONAL_CONFIG_KEY = "graft"


def plan_for(
    deployment: Any,
    *,
    source: str | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    platform: str | None = None,
    engine_model: str | None = None,
    engine_args: dict[str, Any] | None = None,
) -> Plan:
    """The validated plan of ``deployment``; raises :class:`~vllm_graft.hooks.DeploymentError`
    listing every problem.

    ``deployment``: a path to a YAML/JSON file (a relative model path is relative to the
    file's folder); a deployment dict; ``{"__file__": path}`` (the environment route); or
    vLLM's ``additional_config`` (a dict with the deployment under ``"graft"``, or its JSON
    text). ``source`` names it in error messages (default: the file, or what the form is).
    ``base_dir`` resolves a dict's relative model path. ``platform`` overrides the detected one.

    What the engine being started says, checked as if the deployment said it (the bridge
    passes these): ``engine_model``, the model vLLM runs (filled in when the deployment names
    none, refused when it names another; a pre-quantised vllm-graft checkpoint implies its
    quant plugin when the deployment has no ``quant``); ``engine_args``, engine arguments from
    vLLM's own flags (its parallelism and dtype), under the deployment's engine section.
    """
    data, source, base_dir = _read(deployment, source, base_dir)
    if engine_args and isinstance(data.get("engine") or {}, dict):  # a malformed section is validation's
        data["engine"] = {**engine_args, **(data.get("engine") or {})}
    if engine_model is not None:
        given = data.get("model")
        if given is None:
            data["model"] = engine_model
        elif not _same_model(given, engine_model, base_dir):
            raise DeploymentError(
                [
                    Problem(
                        "model",
                        "the deployment names a different model than the engine runs",
                        value=given,
                        accepted=repr(engine_model),
                        hint="drop `model` from the deployment or start vLLM with the same model",
                    )
                ],
                source,
            )
        if data.get("quant") is None:
            implied = checkpoint_deployment(engine_model)
            if implied is not None:
                data["quant"] = implied["quant"]
    env, registry = detect_environment(platform), get_registry()
    last = RUNTIME.validated  # (environment, registry, plan)
    if (
        engine_model is not None
        and last is not None
        and last[0] == env
        and last[1] is registry
        and _canonical(json.loads(deployment_json(last[2]))) == _canonical(data)
    ):
        return last[2]  # handed over by an in-process engine (see "Validated once per process")
    plan = validate(data, registry, env, source=source, base_dir=base_dir)
    if plan.model is not None and plan.deployment.model is not None:
        # absolute: vLLM's processes may run in another working directory, and a path relative
        # to the deployment file means nothing to them
        plan.deployment.model = str(Path(plan.model.path).resolve())
    RUNTIME.validated = (env, registry, plan)
    return plan


def _read(
    deployment: Any, source: str | None, base_dir: str | os.PathLike[str] | None
) -> tuple[dict[str, Any], str, Any]:
    """(a copy of the deployment dict, its source, its base folder) from any accepted form."""
    if isinstance(deployment, str) and deployment.lstrip().startswith("{"):
        deployment = parse_json(deployment, source=source or "--additional-config")
    if isinstance(deployment, dict) and "__file__" in deployment:  # the environment route: named by its file
        deployment, source = deployment["__file__"], None
    if isinstance(deployment, (str, os.PathLike)):
        return load_file(deployment), source or str(deployment), Path(deployment).resolve().parent
    if isinstance(deployment, dict) and ADDITIONAL_CONFIG_KEY in deployment:
        section = graft_section(deployment)
        if section is None:
            raise DeploymentError(
                [
                    Problem(
                        f"additional_config.{ADDITIONAL_CONFIG_KEY}",
                        "is empty",
                        hint="give a deployment there, or leave the key out",
                    )
                ],
                source or "additional_config",
            )
        return _read(section, source or f"additional_config.{ADDITIONAL_CONFIG_KEY}", base_dir)
    if not isinstance(deployment, dict):
        raise DeploymentError(
            [
                Problem(
                    source or "deployment",
                    "must be a mapping (a deployment), or the path of a deployment file",
                    value=deployment,
                )
            ],
            source or "deployment",
        )
    return dict(deployment), source or "deployment", base_dir


def _canonical(data: dict[str, Any]) -> str:
    return json.dumps(data, sort_keys=True, default=str)


def _same_model(given: str, engine_model: str, base_dir: Any) -> bool:
    def norm(p: str, base: Any) -> str:
        q = Path(base, p) if base is not None and not Path(p).is_absolute() else Path(p)
        return str(q.resolve()) if q.exists() else p

    return norm(given, base_dir) == norm(engine_model, None)


def checkpoint_deployment(model: Any) -> dict[str, Any] | None:
    """The deployment a pre-quantised vllm-graft checkpoint (written by ``vllm-graft quantize``)
    implies: its quant plugin with the params it was written with; None for any other model.
    :func:`plan_for` applies it; the bridge asks it only to tell whether a model with no
    deployment given needs one."""
    from .adapters.quant.checkpoint import checkpoint_deployment as implied

    return implied(model)


def graft_section(additional_config: Any) -> dict[str, Any] | None:
    """The deployment in vLLM's ``additional_config`` (a dict, or JSON text), if any."""
    if not additional_config:
        return None
    if isinstance(additional_config, str):
        additional_config = parse_json(additional_config, source="--additional-config")
    if not isinstance(additional_config, dict):
        return None
    graft = additional_config.get(ADDITIONAL_CONFIG_KEY)
    if graft is None:
        return None
    if isinstance(graft, str):
        graft = parse_json(graft, source=f"additional_config.{ADDITIONAL_CONFIG_KEY}")
    return graft


def deployment_json(plan: Plan) -> str:
    """The plan's deployment as every vLLM process receives it."""
    return plan.deployment.to_json()


def deployment_for_engine(plan: Plan) -> dict[str, Any]:
    """The ``additional_config`` that carries ``plan`` into vLLM."""
    return {ADDITIONAL_CONFIG_KEY: json.loads(deployment_json(plan))}


def plan_adapters(plan: Plan) -> list[Adapter]:
    """The adapters of the plan's enabled kinds, in :class:`~vllm_graft.hooks.Kind` order (each
    imported on first use; all are found before any is used). ``adapter.kind`` says whose it is,
    ``plan.by_kind(adapter.kind)`` its plugins."""
    from ..hooks import Kind

    from . import adapters

    return [adapters.adapter_for(kind) for kind in Kind if plan.by_kind(kind)]


__all__ = [
    "plan_for",
    "plan_adapters",
    "graft_section",
    "deployment_for_engine",
    "deployment_json",
    "checkpoint_deployment",
    "ADDITIONAL_CONFIG_KEY",
]
