"""KV-compression adapter: the enabled :class:`~vllm_graft.hooks.KVCompressor` decides, every
step, which KV blocks of each request stay; the others are freed (scheduler) and left out of
attention (worker).

vLLM route
----------
Scheduler half. :class:`GraftKVCompressSpec`, a ``FullAttentionSpec`` subclass, is registered
with vLLM's KV-cache spec registry (``v1/kv_cache_spec_registry.py:
KVCacheSpecRegistry.register``, grouped with full attention) together with its manager
:class:`GraftKVCompressManager`, a subclass of ``v1/core/single_type_kv_cache_manager.py:
FullAttentionManager``. The shared CPU_ATTN backend's ``customize_spec`` (:mod:`..backend`)
turns each plain full-attention layer's spec into it (the spec carries the plugin's name:
vLLM builds specs where no vLLM config is current). The scheduler calls
``remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)`` once per
scheduling of a request (``v1/core/kv_cache_manager.py: KVCacheManager.allocate_slots``,
before it allocates the step's new blocks). The manager then builds a
:class:`~vllm_graft.hooks.BlockView` (``num_tokens`` = the computed tokens; ``pinned`` = held
blocks with ``ref_cnt > 1``, i.e. shared with other requests through the prefix cache), calls
``keep``, checks the answer (:func:`~vllm_graft.hooks.contracts.check_keep`, plus "a freed
block is never kept again") and frees the blocks not kept and not freed yet with the
manager's ``_remove_blocks_in_range``: they become ``null_block`` in the request's table and
return to the block pool (the way R-SWA frees its gap). ``get_num_skipped_tokens`` stays 0.

Worker half. The worker's block table is append-only: it keeps the stale ids of freed
blocks, which the pool hands to other requests, and vLLM's CPU kernel would read them. A
metadata *rewriter* (``backend.SEAMS.rewriters``, run by the backend's builder before the
stock ``CPUAttentionMetadataBuilder.build``) drops, in each row of the batch, the logical
blocks that ``keep`` drops and lowers the row's ``seq_len`` by ``block_size`` per dropped
block (they are full blocks: the last block is always kept). The worker has no scores and
does not hear from the scheduler, so it calls the same ``keep`` with the same view
(``num_tokens`` = ``seq_len - query_len``, the row's prompt length, ``pinned`` empty,
``scores`` None): compressors must be deterministic in those (see
:class:`~vllm_graft.hooks.KVCompressor`); one with ``needs_scores`` decides in the worker
instead (see "The scores channel"). Keys are cached after RoPE, so the kept keys keep their positions; the step's
queries are the last ``query_len`` positions of the shortened row, so causality among them
is unchanged. On the host (the CPU engine) a step whose compressor drops nothing leaves the
metadata as it is (one ``keep`` call per row, no tensor work); on a device every build returns
the rewriter's persistent block table and ``seq_lens`` (:class:`.plan.RowBuffers`: the same
addresses at CUDA-graph capture and at every step, since full graphs keep the addresses they
captured), copied from the runner's on the device and compacted with one host-built index.

(That is the path of deterministic compressors such as ``streaming``; scored ones are below.)
The scheduler frees what ``keep`` dropped at ``processed_computed_tokens``; the worker drops
what ``keep`` drops at the step's computed length, which is never smaller. As dropped blocks
stay dropped, the worker reads a subset of the blocks the scheduler still holds: never a
freed one. (Pinned blocks the worker drops stay held until no longer shared.)

The frees check. That argument needs ``keep`` to be a function of its view, which the contract
requires but nothing enforced: a compressor answering the two calls differently had the worker
read a block the scheduler had freed, and the pool may have handed it to another request,
without a word. So the manager notes each block it frees; a wrapper of ``Scheduler.
_update_after_schedule`` (the end of ``schedule()``) puts the step's frees on the
SchedulerOutput as ``graft_kv_freed`` ``{request id: {block size: [logical blocks]}}`` (none for
a request preempted in that step); the worker's ``execute_model`` wrapper adds them to
``Active.worker_freed`` (forgetting finished, preempted and resumed requests), and the
rewriter leaves out every block the scheduler freed, whatever the worker's own answer kept
(``rows.follow_frees``): the scheduler's frees win, so no freed block is read. A disagreement
is counted (``keep_disagreed``) and said once, naming the plugin, the request and the blocks.
(Before issue 64 the rewriter raised a KeepError there, stopping the engine.)

Prefix-cache salt
-----------------
KV computed while a lossy compressor evicts is not the plain KV of the same tokens, yet the
prefix cache finds blocks by a hash of their tokens (and the request's ``cache_salt``, an
extra key of the first block, which the hash chain carries to every later block). With a
lossy compressor (``capabilities.lossless`` False) the adapter wraps ``v1/request.py:
Request.__init__`` (a patch, owner ``adapters.kvcompress``) so that every request's
``cache_salt`` becomes ``vllm-graft/kvcompress/<name>/<parameters as JSON>`` (followed by
``|<the user's salt>`` if one was given): a compressed request's blocks are served only to
requests of the same compressor and budget, never to plain vLLM through a shared or
offloaded cache, nor across budgets. Within one compressor and budget, a block may still
have been computed under a slightly different eviction history (another prefill chunking):
the approximation is the compressor's own.

The scores channel (``needs_scores`` compressors: ``h2o``, ``snapkv``)
------------------------------------------------------------------------
Where the processes are. vLLM's default engine (``VLLM_ENABLE_V1_MULTIPROCESSING=1``) runs
the scheduler in the engine-core process; on CPU the platform turns the uni-process executor
into the multiprocess one (``platforms/cpu.py``: OMP needs it), so even a single CPU worker
runs in a process of its own. Attention scores exist only in the worker; blocks are freed
only by the scheduler. The channel is the object that already travels from the worker to the
scheduler every step, ``ModelRunnerOutput`` (pickled by the executor's message queue).

Worker. While a scored compressor is active, the backend's attention seam
(``backend.SEAMS.method``) is a scoring attention that runs the compressor's ``attend``
(its reference, or its Triton decode kernel) and adds the mass it reports, per block-table
column, into the step's plan (summed over heads, layers and the queries the compressor's
``score_positions`` selects). After the forward pass (wrappers of ``GPUModelRunner.
execute_model`` and ``sample_tokens``) each row's mass is folded into its request's
per-logical-block scores, ``keep`` is asked with ``num_tokens`` = all computed tokens, the
scores (``-inf`` for blocks dropped before), the step's own mass (``step_scores``) and the
request's id (``request_id``), and the newly dropped blocks are (1) recorded in
the worker, whose rewriter leaves them out of attention from the next step on, and (2) put on
the step's ``ModelRunnerOutput`` as ``graft_kv_drops`` ``{request id: [logical blocks]}``.
Finished, preempted and resumed requests (from the ``SchedulerOutput`` given to
``execute_model``) are forgotten, so a request computed again starts with full attention.

Scheduler. A wrapper of ``Scheduler.update_from_output`` (run before the next
``schedule()``: CPU scheduling is synchronous) records the reported drops per request; the
manager's ``remove_skipped_blocks`` frees them with ``_remove_blocks_in_range``, except
blocks still shared through the prefix cache (``ref_cnt > 1``), which wait until they are
not; ``free()`` (finish, abort, preemption) forgets the request. Safety: the scheduler frees
only what the worker already stopped reading, so a freed block that the pool hands to
another request is never read by the request that gave it up. Cost: a decision frees its
blocks one step later than a deterministic compressor's. The same path runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where the output object is passed as is. Each
process can append its channel events to a file named by ``VLLM_GRAFT_KVCOMPRESS_TRACE``
(tests use it to see the worker decide and the scheduler free in different processes).

Granularity. vLLM frees KV per block and per KV-cache group, so a block's score aggregates
its tokens, all heads and all layers: H2O and SnapKV here choose blocks for all layers at
once, not per layer or per head as in the papers. A per-head compressor (below) chooses per
KV head inside that granularity. A scored compressor brings its own
attention, so it cannot be combined with an attention plugin: refused at validation by the
kind's shape check (``hooks.contracts.kvcompress.shape_problems``), which every combination
rule of a compressor's flags and methods lives in; ``activate`` only wires.

Scoring passes (``scoring_pass`` compressors: ``kvzip``)
-------------------------------------------------------
A compressor may ask for forward passes of its own over given tokens
(``KVCompressor.scoring_passes``: KVzip's "repeat the context" chunks). At the step where a
request's prompt completes, :meth:`.scores._Scores.finalize` (after the step's sampling) runs them
through :mod:`.scoring_forward`: the model's forward on the pass tokens, positions after the
context, with a :class:`.scoring_pass.PassMetadata` for every attention layer and no slot mapping,
which each graft backend (CPU, CUDA, generic) turns into :func:`.scoring_pass.pass_forward`: the
pass's queries over the request's context KV read from the paged cache plus the pass's own K/V in
local tensors; nothing is written, no block allocated, the pass's KV discarded. The per-pair max
attention (layer, KV head, token) is reduced by ``pass_block_scores`` to one score per block
(summed over the tensor-parallel ranks) and added to the request's scores before ``keep`` is
asked; from there the scores channel frees blocks as for any scored compressor. Events:
``scoring_passes`` (requests scored), ``pass_layers`` (layer forwards), ``scoring_pass_us``.

Per KV head (``per_head`` compressors: ``adakv``)
------------------------------------------------
The same channel, with scores per KV head. The scoring attention passes the compressor's
``attend`` a ``head_mask [rows, H_kv, width]`` (False where a row's KV head dropped the block of
that compacted column; built once per step by the plan from each request's per-head dropped
sets) and gets the mass back per KV head (summed over that head's query heads, and over
layers by the plan). After the forward pass each request's per-head scores grow by it,
``keep_heads`` is asked with ``head_scores`` (``-inf`` where that head dropped the block) and
checked per head (:func:`.keep.check_keep_heads`; a block a head dropped stays dropped for it);
the block-level answer is the union over heads (:func:`.keep.union_of_heads`), and only blocks
no head keeps are dropped, skipped and freed as above. The other blocks stay held; each head's
dropped ones are masked out of its attention (event ``head_blocks_dropped``: (head, block)
pairs). The mass per KV head is not summed over tensor-parallel ranks (each rank holds other
heads), so such compressors declare no ``tp``; nor do they combine with a storage format
(refused at activation).

Per layer (``per_layer`` compressors: ``pyramidkv``)
-------------------------------------------------
The same with decoder layers in place of KV heads: each layer's attention gets the mask of the
blocks that layer dropped (``_StepPlan.layer_mask``, by ``AttentionLayer.index``, the same for all
its KV heads), its mass is summed over its KV heads and kept per layer, ``keep_layers`` is asked
with ``layer_scores`` and checked per layer, the union is freed, and each layer's other dropped
blocks are masked (event ``layer_blocks_dropped``: (layer, block) pairs). The per-unit state is
the per-head one's (``head_scores``, ``head_dropped``: per layer here; a compressor is never both).

Storage formats (``KVCacheFormat``, e.g. ``kv4``) and composition
-----------------------------------------------------------------
A deployment's ``kvcompress:`` may list one plugin per role (``KindSpec.roles`` in ``hooks.kinds``):
an eviction compressor and a storage format. The format evicts nothing; alone, it is also the
"compressor" whose ``keep`` (every block) the manager asks. ``customize_spec`` gives the spec
``dtype=uint8`` and ``state_content_bytes`` = the format's bytes per token and KV head, so
vLLM's page size, and the number of blocks in the KV memory, are the format's (the spec
records ``compressor`` = "evictor+format" and ``kv_format``). The backend's impl calls the
format's ``write`` in ``do_kv_cache_update`` and its attention in ``forward`` on ``uint8``
caches (``backend.SEAMS.kv_format``); with a scored evictor the scoring attention asks the
format for the attention and the mass. The prefix-cache salt joins every lossy plugin's salt
(:func:`.salt.composition_salt`).

The metadata patch
------------------
``CommonAttentionMetadata`` has per-row sequence and query lengths but not which request a
row is, nor its prompt length. Row ``i`` is ``runner.input_batch.req_ids[i]`` (the runner
builds the metadata from its input batch in row order: ``GPUModelRunner.
_build_attention_metadata``, inherited by ``CPUModelRunner``). The adapter wraps that method
(through :data:`~vllm_graft.integration.patches.PATCHES`, owner ``adapters.kvcompress``) to
note the runner and the step's ``num_scheduled_tokens`` while the builders run; the rewriter
reads each row's request id and prompt length from ``input_batch`` and checks that the row's
query length is the number of tokens the scheduler gave that request. Dummy/profiling builds
(no scheduler output) are left unchanged.

Events (``RUNTIME.count``): ``steps`` (``keep`` calls in the scheduler), ``blocks_freed``
(blocks returned to the pool), ``worker_steps`` (``keep`` calls in the worker) and
``blocks_skipped`` (row blocks left out of a step's attention, summed over rows and steps).

Modules
-------
vLLM-free (they import no vLLM, so the logic is unit-tested without it):

* :mod:`.keep`: the rules of a ``keep`` answer (:func:`.keep.check_keep`), ``KeepAll``;
* :mod:`.plan`: the per-request decisions: what the scheduler frees (:func:`.plan.blocks_to_free`),
  what the worker leaves out (:func:`.plan.blocks_to_skip`), how a block-table row is compacted;
* :mod:`.state`: the compressor a deployment activated in this process (``state.get_active()``, kept in the adapter's ``KVCompressState`` on the runtime);
* :mod:`.salt`: the prefix-cache salt and the ``Request.__init__`` wrapper that applies it;
* :mod:`.rows`: the worker's batch rows -> requests (the metadata patch's wrapper);
* :mod:`.scores`: scored compressors in the worker: per-block scores, the scoring attention;
* :mod:`.channel`: the scores channel's wrappers (drops on ``ModelRunnerOutput``) and its trace.

The vLLM half: :mod:`.engine` (the adapter, ``ADAPTER``, the patches and the metadata
rewriter) imports vLLM only when a deployment activates it, so the registry can load it in a
process that never starts an engine; :mod:`.vllm_spec` (the KV-cache spec and its manager,
module-level classes that unpickle by name in any process) imports vLLM at module level.
"""
