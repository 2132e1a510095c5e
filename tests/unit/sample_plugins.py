"""A plugin defined in a test module (not installed): registers one plugin per kind with
parameters and capabilities that the validation tests exercise."""
from pydantic import BaseModel, ConfigDict, Field

from vllm_graft.hooks import Capabilities, Registration, hookimpl


class EvictParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sink_blocks: int = Field(1, ge=0, description="blocks kept at the start")
    window_blocks: int = Field(4, ge=1, le=1024, description="recent blocks kept")


class SparseParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    top_k: int = Field(ge=1, description="blocks attended per step")


class MaskParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    experts_off: list[int] = Field(default_factory=list, description="expert ids switched off")


@hookimpl
def graft_register_kv_compressors(register):
    register(Registration(
        name="sample-evict", summary="sinks + window", paper="StreamingLLM (ICLR 2024)",
        params=EvictParams, impl="vllm_graft.plugins.kvcompress.noop.reference:KeepAll",
        capabilities=Capabilities(lossless=False, dtypes=("float32", "float16")),
    ))


@hookimpl
def graft_register_attention(register):
    register(Registration(
        name="sample-sparse", summary="sparse decode", paper="-", params=SparseParams,
        impl="vllm_graft.plugins.attention.noop.reference:PagedAttention",
        capabilities=Capabilities(lossless=False, head_sizes=(128,), platforms=("cuda",)),
    ))


@hookimpl
def graft_register_spec_proposers(register):
    register(Registration(
        name="sample-draft", summary="drafts", paper="-",
        impl="vllm_graft.plugins.speculative.noop.reference:NoDraft",
        capabilities=Capabilities(lossless=True, vllm_versions=">=0.33"),
    ))


@hookimpl
def graft_register_moe_schedulers(register):
    for name in ("sample-mask", "sample-route"):
        register(Registration(
            name=name, summary="masks experts", paper="MoTE", params=MaskParams,
            impl="vllm_graft.plugins.moe.noop.reference:TopK",
            capabilities=Capabilities(lossless=False, architectures=("MixtralForCausalLM",),
                                      incompatible_with=("moe:sample-route",) if name == "sample-mask" else ()),
        ))
