"""The five kinds of plugin, and every fact about a kind in one table (:data:`KINDS`).

Everything that differs by kind reads its :class:`KindSpec`: the registration hook, the
contract class, the deployment section and how many plugins it may enable, the roles plugins
fill, the engine arguments the section owns, how the kind reaches vLLM (its route and
adapter module), the kind's ``noop`` plugin and its docs heading. Adding a sixth kind
starts here (then a hookspec in :mod:`.specs`, a contract in :mod:`.contracts`, a field of
:class:`~vllm_graft.hooks.deployment.Deployment`, an adapter, and a scaffold template; tests
check that each of those covers every kind of this table).

Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Kind(str, enum.Enum):
    """The five kinds of plugin. The value is the deployment-file section name."""

    ATTENTION = "attention"
    KVCOMPRESS = "kvcompress"
    SPECULATIVE = "speculative"
    QUANT = "quant"
    MOE = "moe"

    def __str__(self) -> str:  # "attention", not "Kind.ATTENTION", in messages
        return self.value


@dataclass(frozen=True)
class Role:
    """A role plugins of a kind fill; a deployment enables at most one plugin per role."""

    name: str
    contract: str  # class name in vllm_graft.hooks.contracts
    what: str  # what the role does, for messages


@dataclass(frozen=True)
class KindSpec:
    """The facts about one kind of plugin (see the module docstring)."""

    kind: Kind
    title: str  # docs heading, e.g. "Attention backends"
    hook: str  # the registration hook in vllm_graft.hooks.specs
    contract: str  # the contract class in vllm_graft.hooks.contracts
    allows_many: bool  # whether a deployment may enable several plugins of the kind
    #: per platform ("cpu", "cuda", or "*" for all): how the kind's plugins reach vLLM
    routes: dict[str, str]
    #: roles the kind's plugins fill (composition by role); () = no roles. The first is the
    #: default of a registration that declares none (``Capabilities.role``).
    roles: tuple[Role, ...] = ()
    #: vLLM engine arguments the kind's deployment section sets; setting both is a conflict
    engine_keys: tuple[str, ...] = ()
    noop: str = "noop"  # the built-in plugin that routes through vLLM and changes nothing

    @property
    def section(self) -> str:
        """The deployment-file section (and ``--kind`` value)."""
        return self.kind.value

    @property
    def owner(self) -> str:
        """Who owns the kind's patches of vLLM and its hooks' registrations (the patch
        register's ``owner``, ``vllm-graft patches``): ``adapters.<kind>``."""
        return f"adapters.{self.kind.value}"

    def route(self, platform: str | None) -> str:
        """How the kind reaches vLLM on ``platform`` (both platforms' routes if unknown)."""
        if platform in self.routes:
            return self.routes[platform]
        if "*" in self.routes:
            return self.routes["*"]
        return " / ".join(f"{p}: {r}" for p, r in self.routes.items())

    def role(self, name: str | None) -> Role | None:
        """The role ``name`` (None: the default role), or None if the kind has no such role."""
        if not self.roles:
            return None
        if name is None:
            return self.roles[0]
        return next((r for r in self.roles if r.name == name), None)

    @property
    def role_names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.roles)


_SPECS = (
    KindSpec(
        Kind.ATTENTION,
        "Attention backends",
        "graft_register_attention",
        "AttentionMethod",
        allows_many=False,
        routes={
            "cpu": "attention backend: overrides vLLM's CPU_ATTN backend",
            "cuda": "attention backend: overrides vLLM's FLASH_ATTN, FLASHINFER and "
            "TRITON_ATTN (vLLM's kernel wherever the math is plain attention); "
            "the generic CUSTOM backend for a backend the bridge does not know",
        },
    ),
    KindSpec(
        Kind.KVCOMPRESS,
        "KV-cache compressors",
        "graft_register_kv_compressors",
        "KVCompressor",
        allows_many=True,
        routes={
            "*": "KV-cache spec with its own block manager (evicted blocks return to vLLM's "
            "pool) and an attention backend that reads only the blocks kept"
        },
        roles=(
            Role("eviction", "KVCompressor", "choose which KV blocks stay (eviction compressors)"),
            Role("storage", "KVCacheFormat", "set how KV is stored (storage formats)"),
        ),
    ),
    KindSpec(
        Kind.SPECULATIVE,
        "Speculative-decoding proposers",
        "graft_register_spec_proposers",
        "Proposer",
        allows_many=False,
        routes={"*": "speculative proposer: speculative_config method=custom_class"},
        engine_keys=("speculative_config",),
    ),
    KindSpec(
        Kind.QUANT,
        "Quantization methods",
        "graft_register_quant_methods",
        "QuantMethod",
        allows_many=False,
        routes={"*": "quantization method: register_quantization_config"},
        engine_keys=("quantization",),
    ),
    KindSpec(
        Kind.MOE,
        "MoE schedulers",
        "graft_register_moe_schedulers",
        "MoEScheduler",
        allows_many=True,
        routes={"*": "MoE runner hook: router logits before top-k, expert placement"},
    ),
)

#: Every kind's facts, in the order kinds are listed everywhere.
KINDS: dict[Kind, KindSpec] = {s.kind: s for s in _SPECS}
#: Registration hook -> the kind it registers.
HOOK_KINDS: dict[str, Kind] = {s.hook: s.kind for s in _SPECS}
#: Engine argument -> the kind whose deployment section owns it.
ENGINE_KEYS_OWNED: dict[str, Kind] = {key: s.kind for s in _SPECS for key in s.engine_keys}


def spec(kind: Kind | str) -> KindSpec:
    """The :class:`KindSpec` of ``kind`` (a :class:`Kind` or its section name)."""
    return KINDS[Kind(kind)]


__all__ = ["ENGINE_KEYS_OWNED", "HOOK_KINDS", "KINDS", "Kind", "KindSpec", "Role", "spec"]
assert set(KINDS) == set(Kind), "every Kind needs a KindSpec"
