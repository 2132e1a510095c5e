"""The deployment schema: the pydantic model of a deployment file."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator

from ..kinds import Kind

DTYPE_ALIASES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


# ------------------------------------------------------------------------------ schema
class PluginChoice(BaseModel):
    """One enabled plugin: its registered name and its parameters."""

    model_config = ConfigDict(extra="forbid")

    plugin: str = Field(description="registered plugin name (see `vllm-graft plugins`)")
    params: dict[str, Any] = Field(default_factory=dict, description="the plugin's parameters")


class SpeculativeChoice(PluginChoice):
    """The speculative plugin, and the load it drafts under."""

    max_batch: int | None = Field(
        default=None,
        ge=1,
        description="a stated load limit: draft only in steps of at most this many decoding "
        "requests; a larger step runs as plain vLLM's (no drafts, counted as over_max_batch). "
        "Speculation that is rarely accepted loses to plain vLLM once a step is compute-bound "
        "(reported in issue 64, not re-measured here: 47.8 s against 39.3 s at 48 concurrent requests). None: no limit "
        "(`adaptive` instead measures goodput per batch size)",
    )


def choice_model(kind: Kind) -> type[PluginChoice]:
    """The model of one ``kind`` section's plugin choice (a kind may add fields of its own)."""
    return SpeculativeChoice if kind is Kind.SPECULATIVE else PluginChoice


class Deployment(BaseModel):
    """A deployment file, after schema validation (plugins not yet resolved)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, description="model folder or name")
    platform: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="where vLLM runs")
    engine: dict[str, Any] = Field(default_factory=dict, description="vLLM engine arguments")
    attention: PluginChoice | None = None
    kvcompress: list[PluginChoice] = Field(
        default_factory=list,
        description="one KV compressor, or a list of at most one per role: "
        "one eviction compressor and one storage format (e.g. [streaming, kv4])",
    )
    speculative: SpeculativeChoice | None = None
    quant: PluginChoice | None = None
    moe: list[PluginChoice] = Field(default_factory=list)

    @field_validator("attention", "speculative", "quant", mode="before")
    @classmethod
    def _one_plugin(cls, v: Any, info) -> Any:
        if isinstance(v, list):
            raise ValueError(
                f"only one {info.field_name} plugin can be enabled at a time, got a list of "
                f"{len(v)}; write a single mapping `{info.field_name}: {{plugin: NAME, params: {{...}}}}`"
            )
        return v

    @field_serializer("kvcompress")
    def _kvcompress_as_written(self, v: list[PluginChoice]) -> Any:
        # one compressor travels as the single mapping it is usually written as
        return (
            v[0].model_dump(exclude_defaults=True) if len(v) == 1 else [c.model_dump(exclude_defaults=True) for c in v]
        )

    @field_validator("kvcompress", "moe", mode="before")
    @classmethod
    def _many(cls, v: Any) -> Any:
        if v is None:
            return []
        return [v] if isinstance(v, dict) else v

    def choices(self) -> list[tuple[Kind, PluginChoice]]:
        out: list[tuple[Kind, PluginChoice]] = []
        for kind in Kind:
            value = getattr(self, kind.value)
            for choice in value if isinstance(value, list) else [value]:
                if choice is not None:
                    out.append((kind, choice))
        return out

    def to_json(self) -> str:
        """The form passed to every vLLM process (``--additional-config '{"graft": ...}'``)."""
        return self.model_dump_json(exclude_defaults=True)
