"""One small contract per plugin kind.

A registration's ``impl`` names a class implementing the contract of its kind. The
class is built with its validated parameter model instance alone (``cls(params)``, once per
process that uses it); what else it needs arrives through its contract's methods (see
:class:`PluginImpl`).
The vLLM adapters in ``vllm_graft.integration`` call these methods; nothing here knows
about vLLM, so a plugin is testable with plain tensors.

Shapes follow vLLM's conventions: query ``[T, H, D]`` (tokens of all sequences packed),
paged KV cache ``[num_blocks, H_kv, block_size, 2*D]`` (per block and head: the keys, then the
values; see :func:`split_kv_cache`),
block tables ``[num_seqs, max_blocks]`` of physical block ids.

One module per kind; :data:`CONTRACTS` maps each kind to its contract class.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..kinds import KINDS, Kind
from .attention import (
    BLOCKED,
    CPU_VEC,
    KV_LAYOUTS,
    PACKED,
    AttentionLayer,
    AttentionMethod,
    KVCacheLayout,
    PagedBatch,
    split_kv_cache,
)
from .base import PluginImpl, ShapeProblem
from .kvcompress import (
    BlockView,
    KeepError,
    KVCacheFormat,
    KVCompressor,
    ScoringPass,
    check_keep,
    check_keep_heads,
    check_keep_layers,
    dropped_blocks,
    union_of_heads,
)
from .kvcompress import shape_problems as kvcompress_shape_problems
from .kvpolicy import (
    CacheScores,
    KeepPolicy,
    PolicyCompressor,
    PolicyParams,
)
from .moe import MOE_STEPS, MoEModel, MoEScheduler
from .quant import QuantMethod, StoredTensor
from .speculative import Proposer

#: Contract class per kind (the kind's :attr:`KindSpec.contract`), for validating
#: implementations. Where a kind's plugins fill roles, each role has its own: see
#: :func:`contract_for`.
CONTRACTS: dict[Kind, type[PluginImpl]] = {k: globals()[s.contract] for k, s in KINDS.items()}

#: Per kind, the shape check of a plugin's class beside its contract (``impl`` class, the other
#: plugins enabled as ``(kind, name, impl class or None)``) -> problems; a kind not here has no
#: rules about its flags and methods beyond its contract's abstract methods.
SHAPE_CHECKS: dict[Kind, Callable[[type, Sequence[tuple[str, str, "type | None"]]], list[ShapeProblem]]] = {
    Kind.KVCOMPRESS: kvcompress_shape_problems,
}


def shape_problems(
    kind: Kind | str, impl: type, others: Sequence[tuple[str, str, "type | None"]] = ()
) -> list[ShapeProblem]:
    """What a plugin's class of ``kind`` cannot be, alone or beside ``others`` (see
    :data:`SHAPE_CHECKS`); ``[]`` for a kind without shape rules."""
    check = SHAPE_CHECKS.get(Kind(kind))
    return check(impl, others) if check is not None else []


def contract_for(kind: Kind | str, role: str | None = None) -> type[PluginImpl]:
    """The class a plugin of ``kind`` (filling ``role``, where its kind has roles) implements."""
    r = KINDS[Kind(kind)].role(role)
    return globals()[r.contract] if r is not None else CONTRACTS[Kind(kind)]


__all__ = [
    "CONTRACTS",
    "CacheScores",
    "KeepPolicy",
    "PolicyCompressor",
    "PolicyParams",
    "MOE_STEPS",
    "AttentionLayer",
    "AttentionMethod",
    "BlockView",
    "ScoringPass",
    "KVCacheFormat",
    "KVCompressor",
    "KeepError",
    "check_keep",
    "check_keep_heads",
    "check_keep_layers",
    "dropped_blocks",
    "union_of_heads",
    "MoEModel",
    "MoEScheduler",
    "PagedBatch",
    "PluginImpl",
    "Proposer",
    "QuantMethod",
    "StoredTensor",
    "contract_for",
    "SHAPE_CHECKS",
    "ShapeProblem",
    "shape_problems",
    "split_kv_cache",
    "KVCacheLayout",
    "BLOCKED",
    "PACKED",
    "CPU_VEC",
    "KV_LAYOUTS",
]
