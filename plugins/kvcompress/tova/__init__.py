"""`tova` KV compressor (TOVA, Oren et al. 2024, "Transformers are Multi-State RNNs",
arXiv:2401.06104) at block granularity: once a request holds more than ``budget_blocks``
blocks, keep those the **current** query attends to most, and drop the rest.

TOVA's policy is to evict, at each decoding step, the token with the lowest attention score of
the current query (averaged over heads), with no fixed sink or window: what stays is whatever
the latest query still reads. Here the unit is vLLM's KV block (it frees KV per block, for
every layer and head at once), and the score is the block's mass from this step's queries
(``BlockView.step_scores``), summed over heads and layers; H2O (`h2o`) ranks by the mass
accumulated since the block was written instead. ``sink_blocks`` (0 in the paper, which
observes that the first token is kept by the policy itself) can pin leading blocks.

The mass comes from the worker's shared attention with mass (``kvcompress/_shared``; TOVA
implements no ``attend``): the exact reference, or the Triton decode kernel with
``kernel: triton``. The plugin is its policy alone: ``reference.py`` is 30 lines.
"""

from ....hooks import Capabilities, Registration, hookimpl

from .._shared.params import TopBlocksParams


@hookimpl
def graft_register_kv_compressors(register):
    register(
        Registration(
            name="tova",
            summary="TOVA: keeps the blocks the current query attends to most",
            paper="Oren et al. 2024, Transformers are Multi-State RNNs (arXiv:2401.06104)",
            params=TopBlocksParams,
            impl="vllm_graft.plugins.kvcompress.tova.reference:TOVA",
            # tp: its scores are summed over the ranks' KV heads (tests/e2e/test_tensor_parallel.py)
            capabilities=Capabilities(lossless=False, parallelism=("tp", "dp")),
        )
    )
