"""Speculative adapter: the enabled :class:`~vllm_graft.hooks.Proposer` drafts tokens that
vLLM's target model verifies.

vLLM route
----------
``engine_overrides`` sets ``speculative_config`` to vLLM's out-of-tree proposer method::

    {"method": "custom_class",
     "model": "vllm_graft.integration.adapters.speculative.engine.GraftProposer",
     "num_speculative_tokens": N}

(vLLM imports ``model`` as a dotted path, ``module.Class``; ``module:Class`` is refused.)
``N`` is the plugin's parameter ``num_speculative_tokens`` when its parameter model has a
field of that name, else :data:`DEFAULT_NUM_SPECULATIVE_TOKENS` (4).

vLLM (``v1/spec_decode/custom_class_proposer.py: create_custom_proposer``) builds
``GraftProposer(vllm_config)`` in each worker's model runner (``v1/worker/gpu_model_runner.py:
GPUModelRunner.__init__``, which the CPU runner inherits), calls ``load_model(target_model)``
once (``v1/worker/cpu_model_runner.py: CPUModelRunner.load_model``) and, after each step's
sampling, ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)``
(``GPUModelRunner.propose_draft_token_ids``). Per batch row ``i`` that is: the tokens the
step produced for the request (``[]`` while it is mid-prefill), its length, and its token
ids so far in ``token_ids_cpu[i, :num_tokens_no_spec[i]]``. Verification is vLLM's
rejection sampler (chain only), so greedy output is the target model's.

The one patch
-------------
vLLM hands a ``custom_class`` proposer no request ids and no signal that a request ended.
Both are in the runner: the rows of ``propose`` are ``runner.input_batch.req_ids``, and
``scheduler_output.finished_req_ids`` (requests that finished or were aborted since the
last step) reaches ``GPUModelRunner._update_states`` at the start of every step. So the
adapter wraps ``GPUModelRunner._update_states`` (through :data:`~..patches.PATCHES`, owner
``adapters.speculative``); for runners whose drafter is a :class:`GraftProposer` the wrapper
(1) binds the runner to the proposer (read for ``input_batch.req_ids`` when ``propose``
runs), (2) calls ``Proposer.finish(request_id)`` for each finished request, (3) notes how
many drafts of each request the step verifies (``scheduled_spec_decode_tokens``), and then
calls vLLM's method unchanged. Other runners pay one ``isinstance`` per step. It can go
when vLLM passes request ids and finished requests to custom proposers.

A request's ``finish`` comes with the engine's next step after it ended, as vLLM's own
runner frees its state then: requests that end in the last step before ``LLM.generate``
returns are finished at the start of the engine's next step (e.g. the next ``generate``);
an engine shut down before that never reports them.

Acceptance
----------
What the target kept is in each row's ``sampled_token_ids``: the accepted drafts plus one
token of its own. The adapter passes it to ``Proposer.accepted(request_id, num_accepted,
num_verified)`` and counts it. Events (``RUNTIME.count``): ``propose`` (plugin calls, one
per request and step), ``drafted`` (tokens proposed), ``verified`` (drafts vLLM checked),
``accepted`` (drafts it kept), ``finish`` (requests ended). vLLM's own figures agree with
``verified``/``accepted``: ``LLM(..., disable_log_stats=False).get_metrics()`` has the
counters ``vllm:spec_decode_num_draft_tokens`` and ``vllm:spec_decode_num_accepted_tokens``
(process-wide, so take differences), and ``LLM(..., per_request_spec_decode_metrics=
"summary")`` gives each finished request's ``output.outputs[0].spec_decode_metrics``, with
``num_draft_tokens`` and ``histogram`` (steps by number of drafts accepted); the e2e test
checks both sums against ``verified``/``accepted``.

The target's top-k (optional, second patch)
-------------------------------------------
A proposer that sets :attr:`Proposer.topk` > 0 (Token Recycling) gets, through
:meth:`Proposer.observe_topk`, the target's ``topk`` most probable next tokens at every
position the step computed logits for. vLLM computes those logits in
``GPUModelRunner.execute_model`` (``self.model.compute_logits(sample_hidden_states)``, one
row per ``logits_indices`` entry) and hands them, in ``sample_tokens``, to
``GPUModelRunner._sample(logits, spec_decode_metadata)``, which calls the sampler (no drafts
in the batch: one row per request, in ``input_batch`` order) or the rejection sampler (rows
per request: its ``spec_decode_metadata.num_draft_tokens[i]`` drafts plus the bonus row,
also in ``input_batch`` order). The adapter wraps ``_sample`` (through
:data:`~..patches.PATCHES`, owner ``adapters.speculative``): when the runner's drafter is a
:class:`GraftProposer` whose plugin asked for a top-k, it takes the top-k of the logits
(FlashInfer's ``top_k`` on CUDA where :mod:`vllm_graft.plugins._flashinfer` allows, else
``torch.topk``) *before* vLLM samples (the samplers may scale logits in place), copies the ids to the CPU
and keeps them with the rows per request; ``propose``, run right after in the same step,
passes each request its rows with the tokens they follow (the token before the step, then
the drafts the step verified). Every other runner and proposer pays one ``isinstance`` and
one attribute read per step. It can go when vLLM hands custom proposers the logits.

The drafts ride with the step's output (three more patches)
----------------------------------------------------------
With speculative decoding configured and synchronous scheduling (the CPU engine always: its
platform turns asynchronous scheduling off), vLLM's engine core asks the worker for the step's
drafts in a call of its own after every step (``EngineCore.post_step`` ->
``Executor.take_draft_token_ids``): with the multiprocess executor (the CPU engine's unless
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, and any engine with more than one worker) that is one more round trip through the shared-memory queue
per step, beside ``execute_model`` and ``sample_tokens``, drafts or none. The drafts are known
when ``sample_tokens`` returns (a ``custom_class`` proposer drafts inside it, before the output
is built), so the worker's ``Worker.sample_tokens`` is wrapped to attach them to the
``ModelRunnerOutput`` it returns (attribute ``graft_draft_token_ids``, a ``DraftTokenIds``
or None, exactly what the worker's ``take_draft_token_ids`` would answer) for a runner whose
drafter is a :class:`GraftProposer`, in a worker of the multiprocess executor (an in-process
engine's call costs nothing to skip), and the engine core's
``MultiprocExecutor.sample_tokens`` keeps what came back, which its
``MultiprocExecutor.take_draft_token_ids`` then returns in place of the round trip. Whatever
did not come that way (an asynchronous scheduler's output, a ``non_block`` call, an output
rebuilt by a KV connector's aggregator, another proposer's) takes vLLM's call as before.

The package: the per-step logic (request ids, budget, acceptance, top-k rows, finish) is
:class:`~.drafting.Drafting`, free of vLLM; this module holds what vLLM builds and calls
(:class:`GraftProposer`, which must stay here: its dotted path is :data:`PROPOSER_PATH`),
the patches and the adapter, and imports vLLM only in :func:`install_patch` and the wrappers.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable

from pydantic import BaseModel

from ....hooks import Kind, Plan
from ....hooks.deployment import Enabled

from ... import targets
from ...patches import PATCHES
from ...runtime import RUNTIME, Runtime
from .. import Adapter
from . import tree
from .drafting import Drafting

if TYPE_CHECKING:  # for the doctor's attribute rows: what is read of vLLM's runner
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # the CPU engine's runner subclasses it

OWNER = targets.SPECULATIVE

#: Drafts per step when the plugin's parameters have no ``num_speculative_tokens`` field.
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
#: Parameter field that sets the number of drafts per step.
PARAM_FIELD = "num_speculative_tokens"
#: What vLLM imports as the proposer (``create_custom_proposer`` splits at the last dot).
PROPOSER_PATH = f"{__name__}.GraftProposer"


def num_speculative_tokens(params: BaseModel) -> int:
    """Drafts per step for a plugin with these validated parameters (see module docstring)."""
    if PARAM_FIELD in type(params).model_fields:
        value = getattr(params, PARAM_FIELD)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{PARAM_FIELD} must be a positive integer, got {value!r}")
        return value
    return DEFAULT_NUM_SPECULATIVE_TOKENS


def speculative_config(params: BaseModel) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for a proposer plugin with these parameters."""
    return {"method": "custom_class", "model": PROPOSER_PATH, "num_speculative_tokens": num_speculative_tokens(params)}


def _max_batch() -> int | None:
    """The deployment's ``speculative.max_batch`` (a stated load limit), if any."""
    choice = RUNTIME.plan.deployment.speculative if RUNTIME.plan is not None else None
    return choice.max_batch if choice is not None else None


# --------------------------------------------------------------- what vLLM builds and calls
class GraftProposer:
    """vLLM's ``custom_class`` proposer: delegates to this process's enabled Proposer plugin."""

    def __init__(self, vllm_config: Any) -> None:
        enabled = RUNTIME.enabled(Kind.SPECULATIVE)
        if not enabled:
            raise RuntimeError(
                f"{PROPOSER_PATH} is vllm-graft's proposer and needs a deployment with a "
                "`speculative` plugin (additional_config={'graft': {...}} or "
                "VLLM_GRAFT_DEPLOYMENT); do not set it in speculative_config by hand"
            )
        (e,) = enabled
        spec = vllm_config.speculative_config
        model = vllm_config.model_config

        def count(event: str, n: int = 1, _name: str = e.name) -> None:
            RUNTIME.count(Kind.SPECULATIVE, _name, event, n)

        self.drafting = Drafting(
            RUNTIME.instance(e),
            e.name,
            k=spec.num_speculative_tokens,
            max_model_len=model.max_model_len,
            vocab_size=model.get_vocab_size(),
            count=count,
            max_batch=_max_batch(),
        )
        RUNTIME.track_state(f"speculative/{e.name}/adapter", self.drafting)  # read by `soak`
        self._runner: weakref.ReferenceType | None = None
        self.vllm_config = vllm_config  # for load_model
        #: tree verification (a plugin that drafts trees; :mod:`.tree`), else None
        self.tree = tree.activate_verifier(count) if self.drafting.trees_on else None

    def load_model(self, target_model: Any) -> None:
        """Called once by the runner with the model it loaded. A plugin that drafts with the
        target itself (``needs_target_weights``, :mod:`.target`) gets it described here;
        other plugins see token ids only."""
        plugin = self.drafting.plugin
        if getattr(plugin, "needs_target_weights", False):
            from .target import target_weights

            plugin.attach_target(target_weights(target_model, self.vllm_config))  # type: ignore[attr-defined]  # needs_target_weights proposers have it

    def step_started(self, runner: GPUModelRunner, scheduler_output: SchedulerOutput) -> None:
        """From the patched ``_update_states``, before vLLM updates the batch."""
        if self._runner is None or self._runner() is not runner:
            self._runner = weakref.ref(runner)
        self.drafting.step_started(
            scheduler_output.finished_req_ids,
            scheduler_output.scheduled_spec_decode_tokens,
            getattr(scheduler_output, "total_num_scheduled_tokens", 0),
        )

    def logits_computed(self, logits: Any, spec_decode_metadata: SpecDecodeMetadata) -> None:
        """From the patched ``_sample``, before vLLM samples: keep the top-k the plugin wants."""
        import torch

        from ....plugins._flashinfer import topk_ids  # FlashInfer's top_k on CUDA, else torch.topk

        k = min(self.drafting.topk, int(logits.shape[-1]))
        with torch.no_grad():
            ids = topk_ids(logits, k).to("cpu", torch.int64).numpy()
        if spec_decode_metadata is None:
            rows = [1] * int(logits.shape[0])
        else:
            rows = [d + 1 for d in spec_decode_metadata.num_draft_tokens]
        self.drafting.logits_topk(ids, rows)

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: Any,
        token_ids_cpu: Any,
        slot_mappings: Any = None,
        **_: Any,
    ) -> list[list[int]]:
        runner = self._runner() if self._runner is not None else None
        if runner is None:
            raise RuntimeError(
                "vllm-graft: GraftProposer.propose was called before the runner's "
                "_update_states; is the speculative adapter's patch applied (vllm_graft.integration.patches.PATCHES)?"
            )
        batch = runner.input_batch
        # rows sampled with a request seed: vLLM gives exactly those a torch.Generator
        seeded = [batch.req_ids[i] for i in getattr(batch, "generators", {}) if i < len(batch.req_ids)]
        chain_only = (
            ()
            if self.tree is None
            else [
                rid
                for rid in batch.req_ids
                if rid is not None
                and not tree.tree_verifiable(getattr(runner.requests.get(rid), "sampling_params", None))
            ]
        )
        return self.drafting.propose(
            batch.req_ids, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, seeded=seeded, chain_only=chain_only
        )


def _update_states_wrapper(original: Callable) -> Callable:
    def _update_states(self, scheduler_output):
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, GraftProposer):
            drafter.step_started(self, scheduler_output)
        return original(self, scheduler_output)

    _update_states.__wrapped__ = original  # type: ignore[attr-defined]
    return _update_states


def _sample_wrapper(original: Callable) -> Callable:
    def _sample(self, logits, spec_decode_metadata):
        drafter = getattr(self, "drafter", None)
        if not isinstance(drafter, GraftProposer):
            return original(self, logits, spec_decode_metadata)
        if drafter.drafting.topk and logits is not None:
            drafter.logits_computed(logits, spec_decode_metadata)
        output = original(self, logits, spec_decode_metadata)
        if drafter.tree is not None:
            drafter.tree.verify(self, logits, spec_decode_metadata, output)
        return output

    _sample.__wrapped__ = original  # type: ignore[attr-defined]
    return _sample


def _attention_only(runner: GPUModelRunner) -> bool:
    """Every KV cache group of the runner is attention (no recurrent state such as Mamba or
    GDN, whose backends read the previous step at an offset only the speculative path applies).
    Read once per runner."""
    known = runner.__dict__.get("_graft_attention_only")
    if known is None:
        from vllm.v1.kv_cache_interface import AttentionSpec

        groups = getattr(getattr(runner, "kv_cache_config", None), "kv_cache_groups", None) or ()
        known = bool(groups) and all(isinstance(g.kv_cache_spec, AttentionSpec) for g in groups)
        runner.__dict__["_graft_attention_only"] = known
    return known


def plain_step(runner: GPUModelRunner, scheduler_output: SchedulerOutput) -> bool:
    """This step verifies no drafts, so it may take vLLM's non-speculative path (the plain
    sampler, no rejection sampler or speculative metadata): no request has draft tokens
    scheduled, the scheduling is synchronous (asynchronous scheduling schedules placeholder
    drafts and is left alone) and the model is attention only."""
    return (
        not scheduler_output.scheduled_spec_decode_tokens
        and not getattr(runner, "use_async_scheduling", False)
        and _attention_only(runner)
    )


def _prepare_inputs_wrapper(original: Callable) -> Callable:
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        drafter = getattr(self, "drafter", None)
        if not isinstance(drafter, GraftProposer):
            return original(self, scheduler_output, num_scheduled_tokens)
        if plain_step(self, scheduler_output):
            # vLLM takes the speculative path on every step once speculative decoding is
            # configured (`use_spec_decode = self.speculative_config is not None`, read once
            # here), even when no request has a draft: its rejection sampler and metadata then
            # cost ~10% of a step on a small model (BENCHMARKS.md, "adaptive"). A step with no
            # drafts gets the plain path, as plain vLLM would run it.
            spec = self.speculative_config
            self.speculative_config = None
            try:
                out = original(self, scheduler_output, num_scheduled_tokens)
            finally:
                self.speculative_config = spec
            drafter.drafting.count("plain_steps", 1)
            return out
        out = original(self, scheduler_output, num_scheduled_tokens)
        if drafter.tree is not None:
            drafter.tree.prepare(self, drafter.drafting.step_trees, num_scheduled_tokens)
        return out

    _prepare_inputs.__wrapped__ = original  # type: ignore[attr-defined]
    return _prepare_inputs


DRAFTS_ATTRIBUTE = "graft_draft_token_ids"  # on a ModelRunnerOutput: the step's drafts
_NOT_SENT = object()


def _worker_sample_tokens_wrapper(original: Callable) -> Callable:
    def sample_tokens(self, grammar_output, *args, **kwargs):
        output = original(self, grammar_output, *args, **kwargs)
        rides = self.__dict__.get("_graft_drafts_ride")
        if rides is None:
            rides = self.__dict__["_graft_drafts_ride"] = _rides_from(self)
        if rides and drafts_ride(output):
            drafts = self.model_runner.take_draft_token_ids()
            if drafts is not None:  # a copy of the ids: the runner's list changes next step
                drafts = type(drafts)(list(drafts.req_ids), drafts.draft_token_ids)
            setattr(output, DRAFTS_ATTRIBUTE, drafts)
        return output

    sample_tokens.__wrapped__ = original  # type: ignore[attr-defined]
    return sample_tokens


def _rides_from(worker: Any) -> bool:
    """This worker's drafts ride on its output: its runner drafts with a :class:`GraftProposer`
    and it serves vLLM's multiprocess executor (the one whose ``take_draft_token_ids`` is
    patched to read them; in-process, that call is a method call, and the ride would only cost)."""
    config = getattr(worker, "vllm_config", None)
    backend = getattr(getattr(config, "parallel_config", None), "distributed_executor_backend", None)
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    return backend == "mp" and isinstance(drafter, GraftProposer)


def drafts_ride(output: Any) -> bool:
    """``output`` is a step's own ``ModelRunnerOutput`` (not an asynchronous one, not vLLM's
    shared empty output), the kind the engine core reads synchronously."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    return type(output) is ModelRunnerOutput and output is not EMPTY_MODEL_RUNNER_OUTPUT


def _executor_sample_tokens_wrapper(original: Callable) -> Callable:
    def sample_tokens(self, grammar_output, non_block=False):
        output = original(self, grammar_output, non_block=non_block)
        # a Future (non_block) or an output without drafts: the next take asks the worker
        self.__dict__["_graft_drafts"] = getattr(output, DRAFTS_ATTRIBUTE, _NOT_SENT) if not non_block else _NOT_SENT
        return output

    sample_tokens.__wrapped__ = original  # type: ignore[attr-defined]
    return sample_tokens


def _executor_take_drafts_wrapper(original: Callable) -> Callable:
    def take_draft_token_ids(self):
        drafts = self.__dict__.pop("_graft_drafts", _NOT_SENT)
        if drafts is _NOT_SENT:
            return original(self)
        name = self.__dict__.get("_graft_proposer")
        if name is None:
            enabled = RUNTIME.enabled(Kind.SPECULATIVE)
            name = self.__dict__["_graft_proposer"] = enabled[0].name if enabled else "?"
        RUNTIME.count(Kind.SPECULATIVE, name, "drafts_with_output")
        return drafts

    take_draft_token_ids.__wrapped__ = original  # type: ignore[attr-defined]
    return take_draft_token_ids


def install_patch() -> None:
    """Wrap ``GPUModelRunner._update_states``, ``GPUModelRunner._sample`` and
    ``GPUModelRunner._prepare_inputs``, and send the drafts with the step's output
    (``Worker.sample_tokens``, ``MultiprocExecutor.sample_tokens`` and
    ``.take_draft_token_ids``) (idempotent; why: :mod:`...targets`)."""
    PATCHES.apply(targets.SPEC_SAMPLE, _sample_wrapper)
    PATCHES.apply(targets.SPEC_UPDATE_STATES, _update_states_wrapper)
    PATCHES.apply(targets.SPEC_PREPARE_INPUTS, _prepare_inputs_wrapper)
    PATCHES.apply(targets.SPEC_WORKER_SAMPLE_TOKENS, _worker_sample_tokens_wrapper)
    PATCHES.apply(targets.SPEC_EXECUTOR_SAMPLE_TOKENS, _executor_sample_tokens_wrapper)
    PATCHES.apply(targets.SPEC_EXECUTOR_TAKE_DRAFTS, _executor_take_drafts_wrapper)


# ------------------------------------------------------------------------------ adapter
class SpeculativeAdapter(Adapter[tree.SpeculativeState]):
    kind = Kind.SPECULATIVE
    owner = OWNER
    State = tree.SpeculativeState

    def engine_overrides(self, enabled: list[Enabled], plan: Plan) -> dict[str, Any]:
        (e,) = enabled  # the deployment allows one proposer
        return {"speculative_config": speculative_config(e.params)}

    def activate(self, enabled: list[Enabled], plan: Plan, runtime: Runtime) -> None:
        # The plugin itself is built by GraftProposer, in the worker that drafts.
        num_speculative_tokens(enabled[0].params)  # a bad value fails here, before start-up
        install_patch()
        if tree.drafts_trees(enabled[0], plan):
            tree.install_attention(OWNER)

    def deactivate(self) -> None:
        tree.uninstall_attention(OWNER)
        PATCHES.undo(OWNER)


ADAPTER = SpeculativeAdapter()
