"""`noop` MoE scheduler: the model's own softmax top-k routing, unchanged."""

from ....hooks import Capabilities, NoParams, Registration, hookimpl


@hookimpl
def graft_register_moe_schedulers(register):
    register(
        Registration(
            name="noop",
            summary="Softmax top-k routing as the model defines it (the baseline; changes nothing)",
            paper="-",
            params=NoParams,
            impl="vllm_graft.plugins.moe.noop.reference:TopK",
            capabilities=Capabilities(parallelism=("tp", "dp"), lossless=True, architectures=("MixtralForCausalLM",)),
        )
    )
