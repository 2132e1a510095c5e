"""The typed registry of plugin registrations.

The registration hooks (see :mod:`vllm_graft.hooks.specs`) run once at start-up and
fill a :class:`Registry`; everything after that (deployment validation, the CLI, the
vLLM adapters) reads the registry and never calls a hook again.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Iterable, Literal, get_args, get_origin

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from .kinds import Kind


from .versions import SUPPORTED_VLLM  # noqa: F401  (the default of Capabilities.vllm_versions)

DTYPES = ("float32", "float16", "bfloat16")

#: Attention features a model's config.json can ask for (read by deployment validation,
#: :class:`~vllm_graft.hooks.deployment.ModelInfo`); a plugin lists those it cannot serve in
#: ``Capabilities.unsupported_features``.
MODEL_FEATURES = {
    "sliding_window": "sliding-window attention",
    "mla": "multi-head latent attention (MLA)",
    "encoder_attention": "encoder (bidirectional or cross) attention",
    "alibi": "ALiBi position biases",
    "soft_cap": "attention logit soft-capping",
    "attention_sinks": "learned attention sinks",
}
#: What vllm-graft's attention backend cannot run with a plugin (its forward computes plain
#: causal decoder attention over the paged cache).
ATTENTION_BACKEND_LIMITS = tuple(MODEL_FEATURES)
PLATFORMS = ("cpu", "cuda")
#: vLLM's kinds of parallelism, as a plugin declares them (``Capabilities.parallelism``), each
#: with the engine argument that turns it on.
PARALLELISM = {
    "tp": "tensor_parallel_size",
    "pp": "pipeline_parallel_size",
    "dp": "data_parallel_size",
    "ep": "enable_expert_parallel",
    # dual-batch overlap (vLLM's --enable-dbo, CUDA): the runner splits a step's rows into two
    # micro-batches and builds attention metadata per micro-batch; no plugin has run under it
    # (kvcompress maps row i to input_batch.req_ids[i] and caches its skips per step, which a
    # micro-batch's rows would not follow), so every plugin is refused there until one declares it
    "dbo": "enable_dbo",
}


class Params(BaseModel):
    """Base of a plugin's parameter model, for a model with checks of its own.

    Any pydantic model with ``extra="forbid"`` may be a plugin's parameter model; subclass
    this one (or :class:`KernelParams`) to check the parameters against where the plugin will
    run (the model, dtype, KV block size, platform) before vLLM starts: override
    :meth:`check_deployment`. This is part of every kind's contract; it runs at validation,
    so it must not import torch or the plugin's implementation.
    """

    model_config = ConfigDict(extra="forbid")

    def check_deployment(self, ctx: Any) -> list[str]:
        """Problems with these parameters where the plugin will run, each a message saying
        what is wrong and how to fix it; ``[]`` if none. ``ctx`` is a
        :class:`~vllm_graft.hooks.DeploymentContext`; any of its fields may be ``None``
        (unknown): skip the checks that need it. Default: no problems."""
        return []


class NoParams(Params):
    """Parameter model of a plugin that takes no parameters."""


#: The parameter that chooses between a plugin's two paths (see :class:`KernelParams`).
KERNEL_FIELD = "kernel"


class KernelParams(Params):
    """Base of the parameter model of a plugin that has Triton kernels beside its reference.

    ``kernel: reference`` (the default) runs the plain-PyTorch reference, the CPU path;
    ``kernel: triton`` runs the Triton kernels (on a GPU, or on the CPU under
    ``TRITON_INTERPRET=1``: slow, for exactness checks). The conformance kit's ``parity``
    check runs both on the same inputs and compares them. Subclass it and add your fields::

        class Params(KernelParams):
            window: int = Field(4, ge=1)
    """

    model_config = ConfigDict(extra="forbid")

    kernel: Literal["reference", "triton"] = Field(
        "reference", description="'reference' (plain PyTorch) or 'triton' (the Triton kernels)"
    )


@dataclass(frozen=True)
class ParamFact:
    """One parameter of a plugin's parameter model, as ``vllm-graft plugins NAME`` and
    docs/plugins.md show it."""

    name: str
    type: str
    default: str | None  # its repr; None: required
    bounds: str  # e.g. ">= 1, <= 64" ("" when unbounded)
    description: str

    def line(self) -> str:
        """``name``: type = default (bounds)"""
        text = f"`{self.name}`: {self.type}"
        if self.default is not None:
            text += f" = {self.default}"
        return text + (f" ({self.bounds})" if self.bounds else "")


_BOUND_SIGNS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def param_facts(model: type[BaseModel]) -> list[ParamFact]:
    """The parameters of a plugin's parameter model: name, type, default, bounds, description."""
    out = []
    for name, field in model.model_fields.items():
        if get_origin(field.annotation) is Literal:  # its values: what a deployment may write
            ann = " | ".join(repr(a) for a in get_args(field.annotation))
        else:
            ann = getattr(field.annotation, "__name__", None) or str(field.annotation).replace("typing.", "")
        bounds = [
            f"{sign} {getattr(m, a)}"
            for m in field.metadata
            for a, sign in _BOUND_SIGNS.items()
            if getattr(m, a, None) is not None
        ]
        default = None if field.is_required() else repr(field.default)
        out.append(ParamFact(name, ann, default, ", ".join(bounds), field.description or ""))
    return out


#: The fields of :class:`Capabilities` whose values come from a fixed set: what a value is
#: called (in the message that refuses an unknown one) and the values accepted.
_KNOWN_VALUES: dict[str, tuple[str, Iterable[str]]] = {
    "unsupported_features": ("model feature(s)", MODEL_FEATURES),
    "dtypes": ("dtype(s)", DTYPES),
    "parallelism": ("parallelism", PARALLELISM),
    "platforms": ("platform(s)", PLATFORMS),
}


class Capabilities(BaseModel):
    """What a plugin supports; deployment validation checks each field before start-up.

    ``None`` in a list field means "no restriction".
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtypes: tuple[str, ...] = Field(default=DTYPES, description="model dtypes it runs with")
    head_sizes: tuple[int, ...] | None = Field(default=None, description="attention head sizes")
    platforms: tuple[str, ...] = Field(default=PLATFORMS, description="'cpu' and/or 'cuda'")
    vllm_versions: str = Field(default=SUPPORTED_VLLM, description="PEP 440 specifier")
    architectures: tuple[str, ...] | None = Field(
        default=None, description="HF architectures it applies to, e.g. MixtralForCausalLM"
    )
    lossless: bool = Field(description="True if greedy outputs equal plain vLLM's")
    incompatible_with: tuple[str, ...] = Field(
        default=(),
        description="plugins it cannot be combined with, as 'kind:name', 'name' or 'kind:*' (any of the kind)",
    )
    unsupported_features: tuple[str, ...] = Field(
        default=(), description="model attention features it cannot serve (see MODEL_FEATURES)"
    )
    parallelism: tuple[str, ...] = Field(
        default=("dp",),
        description="vLLM parallelism it has been run under: 'tp' (tensor), 'pp' "
        "(pipeline), 'dp' (data: independent replicas, so every plugin), 'ep' (expert), 'dbo' "
        "(vLLM's dual-batch overlap, --enable-dbo). A plugin that declares nothing is refused "
        "with tensor, pipeline or expert parallelism and with dual-batch overlap",
    )
    parallelism_why: str | None = Field(
        default=None,
        description="why a kind of parallelism is not in `parallelism` (shown when a deployment asks for it)",
    )
    role: str | None = Field(
        default=None,
        description="for kinds where plugins compose by role (KindSpec.roles): the role it "
        "fills, e.g. kvcompress 'eviction' (the default) or 'storage'",
    )

    @field_validator(*_KNOWN_VALUES)
    @classmethod
    def _known(cls, v: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        what, accepted = _KNOWN_VALUES[str(info.field_name)]
        bad = [x for x in v if x not in accepted]
        if bad:
            raise ValueError(f"unknown {what} {bad}; accepted: {list(accepted)}")
        return v

    @field_validator("vllm_versions")
    @classmethod
    def _specifier(cls, v: str) -> str:
        try:
            SpecifierSet(v)
        except InvalidSpecifier as e:
            raise ValueError(f"not a PEP 440 version specifier: {v!r}") from e
        return v

    def supports_vllm(self, version: str) -> bool:
        return SpecifierSet(self.vllm_versions).contains(version, prereleases=True)


class Registration(BaseModel):
    """One plugin as its registration hook declares it.

    ``impl`` is a lazy import path ``"package.module:Attribute"``: nothing heavy (torch,
    Triton) is imported until a deployment actually enables the plugin.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$", description="unique within its kind")
    kind: Kind | None = Field(default=None, description="filled in by the hook that registers it")
    summary: str = Field(min_length=1, description="one line")
    paper: str = Field(description="the paper it implements (title, venue/arXiv), or '-'")
    params: type[BaseModel] = NoParams
    impl: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
    capabilities: Capabilities

    @field_validator("params")
    @classmethod
    def _params_forbid_extra(cls, v: type[BaseModel]) -> type[BaseModel]:
        if not (isinstance(v, type) and issubclass(v, BaseModel)):
            raise ValueError("params must be a pydantic BaseModel subclass")
        if v.model_config.get("extra") != "forbid":
            raise ValueError(
                f"parameter model {v.__name__} must set model_config = ConfigDict(extra='forbid') "
                "so that misspelt parameters are refused"
            )
        if callable(getattr(v, "check_deployment", None)) and not issubclass(v, Params):
            raise ValueError(
                f"parameter model {v.__name__} defines check_deployment but is not a subclass of "
                "vllm_graft.hooks.Params (or KernelParams), so validation would never call it: "
                "derive it from Params"
            )
        return v

    @property
    def package(self) -> str:
        """The package of the plugin: the one holding ``impl``'s module."""
        return self.impl.partition(":")[0].rpartition(".")[0]

    def part(self, module: str) -> Any:
        """Import and return a module of the plugin's package (:attr:`package`), e.g.
        ``part("policy")``. Tools and the kit reach a plugin's own helpers this way, from its
        registration, never by a hard-coded import path."""
        return importlib.import_module(f"{self.package}.{module}")

    def load(self) -> Any:
        """Import and return the implementation named by ``impl``."""
        module, _, attr = self.impl.partition(":")
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj


@dataclass(frozen=True)
class Source:
    """Where a registration came from: the distribution (or module) that registered it."""

    package: str
    version: str
    plugin: str  # the pluggy plugin name (entry-point name for installed plugins)


@dataclass(frozen=True)
class Entry:
    registration: Registration
    source: Source

    @property
    def kind(self) -> Kind:
        assert self.registration.kind is not None
        return self.registration.kind

    @property
    def name(self) -> str:
        return self.registration.name


class RegistryError(Exception):
    """A plugin registered something invalid (duplicate name, wrong kind...)."""


class Registry:
    """Registrations by kind and name. Built once; read by everything after start-up."""

    def __init__(self) -> None:
        self._entries: dict[tuple[Kind, str], Entry] = {}

    def add(self, registration: Registration, source: Source) -> None:
        if registration.kind is None:
            raise RegistryError(f"registration {registration.name!r} has no kind")
        key = (registration.kind, registration.name)
        if key in self._entries:
            other = self._entries[key].source
            raise RegistryError(
                f"{registration.kind} plugin {registration.name!r} is registered twice: by "
                f"{other.package} (plugin {other.plugin!r}) and by {source.package} "
                f"(plugin {source.plugin!r}); uninstall one, or restrict loading with "
                "VLLM_GRAFT_PLUGINS"
            )
        self._entries[key] = Entry(registration, source)

    def get(self, kind: Kind | str, name: str) -> Entry:
        kind = Kind(kind)
        try:
            return self._entries[(kind, name)]
        except KeyError:
            raise KeyError(f"no {kind} plugin named {name!r}; registered: {self.names(kind)}") from None

    def names(self, kind: Kind | str) -> list[str]:
        kind = Kind(kind)
        return sorted(n for (k, n) in self._entries if k == kind)

    def entries(self, kind: Kind | str | None = None) -> list[Entry]:
        items = sorted(self._entries.values(), key=lambda e: (list(Kind).index(e.kind), e.name))
        if kind is None:
            return items
        return [e for e in items if e.kind == Kind(kind)]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple[Kind | str, str]) -> bool:
        kind, name = key
        return (Kind(kind), name) in self._entries
