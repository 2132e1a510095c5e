"""vllm-graft's extension API: hook specifications, the plugin registry, kind contracts and
the deployment schema. Nothing here imports vLLM (a test checks this)."""
from .contracts import (
    CONTRACTS,
    contract_for,
    AttentionLayer,
    AttentionMethod,
    BlockView,
    KeepError,
    KVCacheFormat,
    KVCompressor,
    MoEModel,
    MoEScheduler,
    PagedBatch,
    PluginImpl,
    Proposer,
    QuantMethod,
    StoredTensor,
    check_keep,
    check_keep_heads,
    dropped_blocks,
    split_kv_cache,
    union_of_heads,
    BLOCKED,
    KV_LAYOUTS,
    PACKED,
    KVCacheLayout,
)
from .contracts.target import SelfSpeculativeProposer, TargetLayer, TargetWeights
from .kinds import KINDS, Kind, KindSpec, Role, spec
from .deployment import (
    Deployment,
    DeploymentContext,
    DeploymentError,
    Environment,
    Plan,
    PluginChoice,
    Problem,
    validate,
    validate_file,
)
from .manager import (
    ENTRY_POINT_GROUP,
    GraftPluginManager,
    PluginLoadError,
    get_plugin_manager,
    get_registry,
    make_plugin_manager,
)
from .registry import (
    KERNEL_FIELD,
    Capabilities,
    KernelParams,
    NoParams,
    Params,
    Registration,
    Registry,
    RegistryError,
)
from .specs import hookimpl, hookspec

__all__ = [
    "CONTRACTS", "AttentionLayer", "AttentionMethod", "BlockView", "Capabilities", "Deployment",
    "DeploymentContext",
    "DeploymentError", "ENTRY_POINT_GROUP", "Environment", "GraftPluginManager", "KERNEL_FIELD",
    "KINDS", "KVCacheFormat", "KVCompressor", "KeepError", "KernelParams", "Kind", "KindSpec", "Role", "spec", "MoEModel", "MoEScheduler", "NoParams", "Params", "PagedBatch",
    "Plan", "PluginChoice", "PluginImpl",
    "PluginLoadError", "Problem", "Proposer", "QuantMethod", "StoredTensor", "Registration", "Registry",
    "RegistryError", "SelfSpeculativeProposer", "TargetLayer", "TargetWeights", "get_plugin_manager", "get_registry", "hookimpl", "hookspec",
    "check_keep", "check_keep_heads", "contract_for", "dropped_blocks", "make_plugin_manager",
    "split_kv_cache", "KVCacheLayout", "BLOCKED", "PACKED", "KV_LAYOUTS", "union_of_heads", "validate", "validate_file",
]
