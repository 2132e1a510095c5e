"""The patch register: every place in vLLM that vllm-graft patches, or reaches into past its
public API, with why, for which plugins, and on which model runner it runs.

This is the one file to read before upgrading vLLM. Everything patches only through
:meth:`~vllm_graft.integration.patches.PatchRegistry.apply` with an entry of :data:`TARGETS`:
the reason, the owner (a kind's ``KindSpec.owner`` from ``hooks/kinds.py``, or :data:`BRIDGE`,
:data:`BENCH`), the checked range (``hooks/versions.py``), the wrapper (``module:function``,
which ``apply`` insists on), the upstream issue or PR and when to remove it come from here, and
``vllm-graft doctor --vllm-source DIR|WHEEL`` checks every entry statically against a vLLM
source tree or wheel: the module, the class, the attribute, the parameters the replacement
relies on. The doctor finds the rest on its own (every ``from vllm... import`` in the package,
every method a vLLM subclass of ours overrides). ``vllm-graft patches`` lists what a deployment
applies.

Model runner. vLLM 0.33 on CUDA runs Model Runner V2 (``vllm/v1/worker/gpu/model_runner.py``)
by default, which does not call any method of the V1 ``GPUModelRunner``; a target with
``runner="v1"`` is reached only under V1. A deployment whose patches include one gets V1
(:mod:`.runner`), or is refused where V1 cannot be had. :data:`RUNNER_FACTS` are the facts
about vLLM that this rests on, checked by the doctor too.

vLLM-free: it only names things.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..hooks.kinds import KINDS, Kind
from ..hooks.versions import SUPPORTED_VLLM

V1_RUNNER = "vllm.v1.worker.gpu_model_runner"  # GPUModelRunner of Model Runner V1
BRIDGE = "bridge"  # the front end (integration/bridge.py)
BENCH = "tools.bench"  # `vllm-graft bench` only, never a deployment
ATTENTION, KVCOMPRESS, SPECULATIVE, QUANT, MOE = (
    KINDS[k].owner for k in (Kind.ATTENTION, Kind.KVCOMPRESS, Kind.SPECULATIVE, Kind.QUANT, Kind.MOE)
)


@dataclass(frozen=True)
class Target:
    owner: str  # who needs it: BRIDGE, BENCH or a kind's KindSpec.owner ("adapters.<kind>")
    module: str  # e.g. "vllm.v1.worker.gpu_model_runner"
    qualname: str  # the class ("" for a module attribute)
    attribute: str  # what is patched or used
    reason: str  # why vLLM's own hooks are not enough
    action: str = "patch"  # "patch": replaced; "use": called or read (private or unstable)
    params: tuple[str, ...] = ()  # parameters the replacement (or the call) relies on
    versions: str = SUPPORTED_VLLM  # the range it was checked against
    # a patch's way out (shown by `vllm-graft patches`): the upstream issue or PR that would make
    # it unnecessary, or "none found" and what vLLM would need; and when to remove it
    upstream: str = ""
    remove_when: str = ""
    #: a patch's replacement, ``module:qualname`` under ``vllm_graft.`` (a function taking the
    #: original); PatchRegistry.apply refuses any other, so the entry says where the patch lives
    wrapper: str = ""

    @property
    def where(self) -> str:
        return ".".join(x for x in (self.module, self.qualname, self.attribute) if x)

    @property
    def runner(self) -> str:
        """``"v1"`` where only Model Runner V1 reaches it, else ``"any"``."""
        return "v1" if self.module == V1_RUNNER else "any"

    def resolve(self):
        """The object that holds :attr:`attribute` (imports vLLM)."""
        import importlib

        obj = importlib.import_module(self.module)
        for part in filter(None, self.qualname.split(".")):
            obj = getattr(obj, part)
        return obj


_SCORES = (
    "a score-based compressor decides in the worker (which has the attention scores) and "
    "the scheduler frees; the decision rides on the ModelRunnerOutput the worker returns "
    "each step (pickled across processes in vLLM's multiprocess executor)"
)

CREATE_ENGINE_CONFIG = Target(
    BRIDGE,
    "vllm.engine.arg_utils",
    "EngineArgs",
    "create_engine_config",
    "vLLM has no hook that sees additional_config before it builds the engine; the deployment "
    "must be validated, activated and exported to child processes there",
    upstream=(
        "none found: a general plugin gets no call with the engine arguments before the "
        "config is built (Platform.pre_register_and_update, vllm#12432, exists for "
        "platform plugins only)"
    ),
    remove_when=("vLLM calls general plugins with EngineArgs (additional_config included) before create_engine_config"),
    wrapper="integration.bridge:_create_engine_config",
)

REPORT_SHUTDOWN_GRACE = Target(
    BRIDGE,
    "vllm.v1.engine.utils",
    "",
    "get_engine_process_shutdown_timeout",
    "at vLLM's default shutdown_timeout=0 the front end SIGKILLs the engine core and its "
    "workers right after their SIGTERM (v1/utils.py shutdown: no join time, then "
    "kill_process_tree), so a worker's last plugin events never reach its report; while "
    "VLLM_GRAFT_REPORT_DIR is set the processes get a grace window to exit (they are killed "
    "only if still alive after it), as vLLM already gives ROCm",
    params=("request_timeout", "process_timeout"),
    upstream="none found: vLLM grants this window only for ROCm's device teardown",
    remove_when="vLLM gives every platform a process grace window after an immediate abort",
    wrapper="integration.bridge:_report_shutdown_grace",
)

KV_REQUEST_INIT = Target(
    KVCOMPRESS,
    "vllm.v1.request",
    "Request",
    "__init__",
    "KV computed while a lossy compressor evicts blocks is not the plain KV of its tokens; the "
    "prefix cache hashes blocks by tokens (and cache_salt), so every request's cache_salt gets "
    "the compressor's name and parameters in front: blocks are shared only between requests of "
    "the same compressor and budget",
    params=("cache_salt",),
    upstream=("none found: cache_salt is per request; no engine-level key enters the block hashes"),
    remove_when=("vLLM folds a KV-cache spec or engine-level key into prefix-cache block hashes"),
    wrapper="integration.adapters.kvcompress.salt:request_init_wrapper",
)
KV_BUILD_METADATA = Target(
    KVCOMPRESS,
    V1_RUNNER,
    "GPUModelRunner",
    "_build_attention_metadata",
    "the attention-metadata builder sees batch rows but not their requests; KV compression "
    "needs each row's request (input_batch.req_ids) and prompt length to drop the blocks the "
    "scheduler freed",
    params=("num_scheduled_tokens", "for_cudagraph_capture"),
    upstream=(
        "token eviction asked in vllm#3532 (H2O; closed as stale); no issue asks for "
        "request ids in CommonAttentionMetadata"
    ),
    remove_when="the metadata builders get each row's request id, or vLLM leaves freed blocks out of the worker's block table itself",
    wrapper="integration.adapters.kvcompress.rows:build_attention_metadata_wrapper",
)
KV_EXECUTE_MODEL = Target(
    KVCOMPRESS,
    V1_RUNNER,
    "GPUModelRunner",
    "execute_model",
    _SCORES + " (worker: forget finished/preempted requests, attach drops)",
    params=("scheduler_output",),
    upstream=("none found: only KV connectors carry per-request data between worker and scheduler"),
    remove_when=(
        "ModelRunnerOutput/SchedulerOutput carry an extension field vLLM hands the KV cache manager (and the worker)"
    ),
    wrapper="integration.adapters.kvcompress.channel:execute_model_wrapper",
)
KV_SAMPLE_TOKENS = Target(
    KVCOMPRESS,
    V1_RUNNER,
    "GPUModelRunner",
    "sample_tokens",
    _SCORES + " (worker: attach the step's drops)",
    upstream="none found (as KV_EXECUTE_MODEL)",
    remove_when="ModelRunnerOutput carries an extension field vLLM hands the KV cache manager",
    wrapper="integration.adapters.kvcompress.channel:sample_tokens_wrapper",
)
KV_UPDATE_FROM_OUTPUT = Target(
    KVCOMPRESS,
    "vllm.v1.core.sched.scheduler",
    "Scheduler",
    "update_from_output",
    _SCORES + " (scheduler: record the drops; the KV manager frees them)",
    params=("scheduler_output", "model_runner_output"),
    upstream="none found (as KV_EXECUTE_MODEL)",
    remove_when=("the scheduler hands a ModelRunnerOutput extension field to the KV cache manager"),
    wrapper="integration.adapters.kvcompress.channel:update_from_output_wrapper",
)
KV_AFTER_SCHEDULE = Target(
    KVCOMPRESS,
    "vllm.v1.core.sched.scheduler",
    "Scheduler",
    "_update_after_schedule",
    "a rule-based compressor's keep() is asked twice per step, by the scheduler (which frees) and "
    "by the worker (which leaves blocks out of attention); the blocks the scheduler freed this "
    "step ride on the SchedulerOutput it hands the worker (end of schedule(); Scheduler.schedule "
    "itself is the bench's), so the worker can check it never reads one",
    params=("scheduler_output",),
    upstream="none found (as KV_EXECUTE_MODEL)",
    remove_when="SchedulerOutput carries the KV cache manager's frees, or vLLM rewrites the worker's block table from them",
    wrapper="integration.adapters.kvcompress.channel:after_schedule_wrapper",
)

SPEC_SAMPLE = Target(
    SPECULATIVE,
    V1_RUNNER,
    "GPUModelRunner",
    "_sample",
    "a custom_class proposer never sees the target's logits; Token Recycling needs the top-k "
    "next tokens at each verified position (Proposer.topk/observe_topk), taken from the logits "
    "_sample receives before the (rejection) sampler runs; a draft tree is verified from the same "
    "logits after it (adapters/speculative/tree.py)",
    params=("logits", "spec_decode_metadata"),
    upstream="vllm#36219 (RFC: one proposer interface, open) and vllm#39487 (custom callable proposer, merged): neither gives a proposer the target's logits; vLLM's tree attention verifies EAGLE trees only",
    remove_when="the proposer interface receives the target's top-k at verified positions and verifies custom_class trees",
    wrapper="integration.adapters.speculative.engine:_sample_wrapper",
)
SPEC_UPDATE_STATES = Target(
    SPECULATIVE,
    V1_RUNNER,
    "GPUModelRunner",
    "_update_states",
    "a custom_class proposer gets no request ids and no finished/aborted signal; the runner's "
    "_update_states sees both (input_batch.req_ids, scheduler_output.finished_req_ids) and the "
    "drafts each step verifies",
    params=("scheduler_output",),
    upstream="vllm#36219 (RFC: one proposer interface, open)",
    remove_when="the proposer interface receives request ids, finished requests and each step's verified drafts",
    wrapper="integration.adapters.speculative.engine:_update_states_wrapper",
)
SPEC_PREPARE_INPUTS = Target(
    SPECULATIVE,
    V1_RUNNER,
    "GPUModelRunner",
    "_prepare_inputs",
    "vLLM verifies chains only: a draft tree's nodes need rotary positions by depth, not by "
    "index (adapters/speculative/tree.py); the positions are rewritten after vLLM computed them "
    "and the KV slots from them. And vLLM takes its speculative path (rejection sampler, "
    "speculative metadata) on every step once speculative decoding is configured, even one with "
    "no drafts; such a step (synchronous scheduling, attention-only model) gets the plain path",
    params=("scheduler_output", "num_scheduled_tokens"),
    upstream="none found: vLLM's tree attention serves EAGLE's own trees only; the every-step "
    "speculative path came with recurrent (GDN/Mamba) backends' zero-draft rows",
    remove_when="vLLM verifies a custom_class proposer's draft tree (positions by depth) and "
    "samples a step with no drafts without its rejection sampler",
    wrapper="integration.adapters.speculative.engine:_prepare_inputs_wrapper",
)
_DRAFTS_RIDE = (
    "with synchronous scheduling vLLM's engine core asks the worker for each step's drafts in a "
    "call of its own (EngineCore.post_step -> Executor.take_draft_token_ids): with the "
    "multiprocess executor one more round trip per step, drafts or none; a custom_class "
    "proposer's drafts are ready when sample_tokens returns, so they ride on its output"
)
SPEC_WORKER_SAMPLE_TOKENS = Target(
    SPECULATIVE,
    "vllm.v1.worker.gpu_worker",
    "Worker",
    "sample_tokens",
    _DRAFTS_RIDE + " (worker: attach them)",
    params=("grammar_output",),
    upstream="none found: with asynchronous scheduling (vLLM's CUDA default) the worker keeps the drafts itself",
    remove_when="ModelRunnerOutput carries the step's drafts under synchronous scheduling",
    wrapper="integration.adapters.speculative.engine:_worker_sample_tokens_wrapper",
)
SPEC_EXECUTOR_SAMPLE_TOKENS = Target(
    SPECULATIVE,
    "vllm.v1.executor.multiproc_executor",
    "MultiprocExecutor",
    "sample_tokens",
    _DRAFTS_RIDE + " (engine core: keep them)",
    params=("grammar_output", "non_block"),
    upstream="none found (as SPEC_WORKER_SAMPLE_TOKENS)",
    remove_when="ModelRunnerOutput carries the step's drafts under synchronous scheduling",
    wrapper="integration.adapters.speculative.engine:_executor_sample_tokens_wrapper",
)
SPEC_EXECUTOR_TAKE_DRAFTS = Target(
    SPECULATIVE,
    "vllm.v1.executor.multiproc_executor",
    "MultiprocExecutor",
    "take_draft_token_ids",
    _DRAFTS_RIDE + " (engine core: answer from them, no round trip)",
    upstream="none found (as SPEC_WORKER_SAMPLE_TOKENS)",
    remove_when="ModelRunnerOutput carries the step's drafts under synchronous scheduling",
    wrapper="integration.adapters.speculative.engine:_executor_take_drafts_wrapper",
)

BENCH_SCHEDULE = Target(
    BENCH,
    "vllm.v1.core.sched.scheduler",
    "Scheduler",
    "schedule",
    "vLLM exposes no per-step KV block count; the bench samples the block pool right after "
    "each allocation (only in `vllm-graft bench`, never in a deployment)",
    upstream="none found: vllm:kv_cache_usage_perc is a gauge sampled per stats interval",
    remove_when="vLLM's stats expose KV blocks in use per engine step",
    wrapper="tools.bench.arm:_KVSampler.wrap",
)

#: Private or unstable vLLM names the adapters call or read (no patch, but an upgrade can
#: break them just the same).
USES: tuple[Target, ...] = (
    Target(
        ATTENTION,
        "vllm.v1.attention.backends.registry",
        "AttentionBackendEnum",
        "CPU_ATTN",
        "the CPU engine's backend, overridden with vllm-graft's subclass",
        "use",
    ),
    Target(
        ATTENTION,
        "vllm.v1.attention.backends.registry",
        "AttentionBackendEnum",
        "CUSTOM",
        "the backend vllm-graft registers on CUDA",
        "use",
    ),
    Target(
        ATTENTION,
        "vllm.v1.attention.backends.registry",
        "AttentionBackendEnum",
        "clear_override",
        "undo the override when the last adapter using the backend deactivates",
        "use",
    ),
    Target(
        ATTENTION,
        "vllm.v1.attention.selector",
        "",
        "_cached_get_attn_backend",
        "vLLM caches the selected backend class; a later engine in the process must see the current registration",
        "use",
    ),
    Target(
        KVCOMPRESS,
        "vllm.v1.kv_cache_spec_registry",
        "KVCacheSpecRegistry",
        "_ensure_registered",
        "the registry fills itself lazily; the spec is registered after vLLM's own",
        "use",
    ),
    Target(
        KVCOMPRESS,
        "vllm.v1.core.single_type_kv_cache_manager",
        "FullAttentionManager",
        "_remove_blocks_in_range",
        "frees the evicted blocks the way R-SWA frees its gap",
        "use",
        params=("request_id", "first_block", "last_block"),
    ),
    Target(
        BRIDGE,
        "vllm.config.vllm",
        "VllmConfig",
        "use_v2_model_runner",
        "read after vLLM builds its config: a deployment with a V1-only patch must get V1",
        "use",
    ),
    Target(
        BRIDGE,
        "vllm.envs",
        "",
        "disable_envs_cache",
        "vLLM caches its environment once an engine is up; a second engine in the process "
        "must see VLLM_USE_V2_MODEL_RUNNER as vllm-graft set it",
        "use",
    ),
    Target(
        MOE,
        "vllm.model_executor.custom_op",
        "",
        "op_registry_oot",
        "vLLM has no unregister for register_oot; deactivate removes the MoERunner entry",
        "use",
    ),
    Target(
        MOE,
        "vllm.distributed.eplb.policy",
        "",
        "EPLB_POLICIES",
        "EPLBConfig.policy accepts only 'default' (a Literal), so a plugin's expert placement is "
        "given to vLLM's load balancer by replacing that entry, which EplbState reads when it is "
        "built (adapters/moe/eplb.py)",
        "use",
    ),
)

#: Every patch, in the order of the owners above.
PATCH_TARGETS: tuple[Target, ...] = (
    CREATE_ENGINE_CONFIG,
    REPORT_SHUTDOWN_GRACE,
    KV_REQUEST_INIT,
    KV_BUILD_METADATA,
    KV_EXECUTE_MODEL,
    KV_SAMPLE_TOKENS,
    KV_UPDATE_FROM_OUTPUT,
    KV_AFTER_SCHEDULE,
    SPEC_SAMPLE,
    SPEC_UPDATE_STATES,
    SPEC_PREPARE_INPUTS,
    SPEC_WORKER_SAMPLE_TOKENS,
    SPEC_EXECUTOR_SAMPLE_TOKENS,
    SPEC_EXECUTOR_TAKE_DRAFTS,
    BENCH_SCHEDULE,
)

TARGETS: tuple[Target, ...] = PATCH_TARGETS + USES


@dataclass(frozen=True)
class RunnerFact:
    """A fact about vLLM's model-runner selection that :mod:`.runner` relies on, checked by
    the doctor as "``file`` matches the regular expression ``pattern``" (read, not run)."""

    claim: str
    file: str
    pattern: str


RUNNER_FACTS: tuple[RunnerFact, ...] = (
    RunnerFact(
        "the runner is chosen by VllmConfig.use_v2_model_runner",
        "vllm/config/vllm.py",
        r"def use_v2_model_runner\(self\)",
    ),
    RunnerFact(
        "VLLM_USE_V2_MODEL_RUNNER=0 selects V1 (read before vLLM's own default)",
        "vllm/config/vllm.py",
        r"use_v2_model_runner = envs\.VLLM_USE_V2_MODEL_RUNNER\s+if use_v2_model_runner is not None:"
        r"\s+return use_v2_model_runner",
    ),
    RunnerFact(
        "the variable is read as int: 0 or 1",
        "vllm/envs.py",
        r"def maybe_convert_bool\(.*\n(.*\n){0,3}\s+return bool\(int\(value\)\)",
    ),
    RunnerFact(
        "the CUDA worker builds the V1 GPUModelRunner when V2 is off",
        "vllm/v1/worker/gpu_worker.py",
        r"from vllm\.v1\.worker\.gpu_model_runner import GPUModelRunner",
    ),
    RunnerFact(
        "the CPU worker's V1 runner subclasses GPUModelRunner",
        "vllm/v1/worker/cpu_model_runner.py",
        r"class CPUModelRunner\(GPUModelRunner\)",
    ),
    RunnerFact(
        "a custom_class proposer is not supported by V2 (vLLM itself picks V1)",
        "vllm/config/vllm.py",
        r"def _get_v2_model_runner_unsupported_features[^@]*?speculative_config\.method in \([^)]*\"custom_class\"",
    ),
    RunnerFact(
        "the V2 runner builds attention metadata with each backend's own builder (the "
        "attention backend's seams run under both runners)",
        "vllm/v1/worker/gpu/attn_utils.py",
        r"get_metadata_builder\(",
    ),
)
