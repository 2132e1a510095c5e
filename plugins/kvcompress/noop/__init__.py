"""`noop` KV compressor: keeps every block (the uncompressed baseline)."""

from ....hooks import Capabilities, NoParams, Registration, hookimpl


@hookimpl
def graft_register_kv_compressors(register):
    register(
        Registration(
            name="noop",
            summary="Keeps every KV block (the uncompressed baseline; changes nothing)",
            paper="-",
            params=NoParams,
            impl="vllm_graft.plugins.kvcompress.noop.reference:KeepAll",
            capabilities=Capabilities(parallelism=("tp", "dp"), lossless=True),
        )
    )
