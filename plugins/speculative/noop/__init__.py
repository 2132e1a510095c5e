"""`noop` proposer: proposes no draft tokens (decoding as without speculation)."""

from ....hooks import Capabilities, NoParams, Registration, hookimpl


@hookimpl
def graft_register_spec_proposers(register):
    register(
        Registration(
            name="noop",
            summary="Proposes no draft tokens (the no-speculation baseline)",
            paper="-",
            params=NoParams,
            impl="vllm_graft.plugins.speculative.noop.reference:NoDraft",
            capabilities=Capabilities(parallelism=("tp", "dp"), lossless=True),
        )
    )
