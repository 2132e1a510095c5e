"""Parameters of the compressors that keep the top blocks by one score per block (``tova``,
``knorm``, ``keydiff``): the keep policy's (``hooks.contracts.kvpolicy.PolicyParams``) with
``sink_blocks``; and the checks the eviction compressors' parameter models share (each model's
validator calls the ones its fields need, saying what its own rule protects)."""

from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import Field, ValidationInfo, model_validator

from ....hooks import Capabilities, Params, PolicyParams
from ....hooks.deployment import param_path

P = TypeVar("P")


def sinks_leave_room(params: P, needs: str) -> P:
    """``params``, or a ValueError when its ``sink_blocks`` take the whole ``budget_blocks``
    (``needs``: what needs a block of the budget besides them)."""
    p: Any = params
    if p.sink_blocks >= p.budget_blocks:
        raise ValueError(
            f"sink_blocks ({p.sink_blocks}) must be smaller than budget_blocks ({p.budget_blocks}): {needs}"
        )
    return params


def fixed_blocks_fit(params: P, rest: str = "") -> P:
    """``params``, or a ValueError when its ``sink_blocks`` and ``recent_blocks`` (always kept)
    exceed ``budget_blocks`` (``rest``: what the message adds, e.g. what the rest holds)."""
    p: Any = params
    if p.sink_blocks + p.recent_blocks > p.budget_blocks:
        raise ValueError(
            f"sink_blocks + recent_blocks ({p.sink_blocks} + {p.recent_blocks}) must not "
            f"exceed budget_blocks ({p.budget_blocks}){rest}"
        )
    return params


def held_blocks_field(unit: str, most: str = "") -> Any:
    """The ``held_blocks`` parameter of a compressor whose units (``unit``: "head", "layer")
    each keep their own blocks: the cap on their union, which a request holds (``most``: what
    the union is at most without it)."""
    return Field(
        None,
        ge=2,
        description=f"at most this many prompt blocks held per request (the union over {unit}s: vLLM frees a "
        f"block only when no {unit} keeps it); None: the union as chosen{most}",
    )


def held_blocks_fit(params: P, keepers: str) -> P:
    """``params``, or a ValueError when its ``held_blocks`` (the cap on the union of the blocks
    that the units, KV heads or layers, keep) is below ``budget_blocks`` (a unit's average:
    ``keepers`` say whose, e.g. "a head keeps")."""
    p: Any = params
    if p.held_blocks is not None and p.held_blocks < p.budget_blocks:
        raise ValueError(
            f"held_blocks ({p.held_blocks}) must be at least budget_blocks ({p.budget_blocks}): {keepers} "
            "budget_blocks prompt blocks on average, all of them held; raise held_blocks or lower budget_blocks"
        )
    return params


class TopBlocksParams(PolicyParams):
    sink_blocks: int = Field(0, ge=0, description="leading blocks always kept (the papers keep none)")

    @model_validator(mode="after")
    def _room(self):
        return sinks_leave_room(self, "the block being written is always kept")


def storage_capabilities(parallelism: tuple[str, ...], **more: Any) -> Capabilities:
    """What a KV storage format (``kv4``, ``million``, ``xquant``: a uint8 cache of its own codes,
    written and attended by its own code) supports: float caches, the common head sizes, plain
    causal decoder attention only; ``more`` narrows it (``platforms``, ``architectures``)."""
    return Capabilities(
        **more,
        parallelism=parallelism,
        lossless=False,
        role="storage",
        dtypes=("float32", "float16", "bfloat16"),
        head_sizes=(32, 64, 96, 128, 256),
        unsupported_features=("sliding_window", "mla", "encoder_attention", "alibi", "soft_cap", "attention_sinks"),
    )


class CalibratedFileParams(Params):
    """The parameters of a storage format that reads a calibrated file (``million``'s codebooks,
    ``xquant``'s bases) named by the field ``FILE``, or the ``BUILTIN`` stand-in: the path resolved
    as ``model``'s, the file's existence checked (its fix: ``CALIBRATE``), and at deployment
    validation the format's layout (``layout_why``) and the file (``file_why``) against the model."""

    FILE: ClassVar[str]
    BUILTIN: ClassVar[str]
    CALIBRATE: ClassVar[str]

    @model_validator(mode="before")
    @classmethod
    def _resolve_file(cls, data: Any, info: ValidationInfo) -> Any:
        value = data.get(cls.FILE) if isinstance(data, dict) else None
        if isinstance(value, str) and value != cls.BUILTIN:
            data = {**data, cls.FILE: str(param_path(value, info))}
        return data

    @model_validator(mode="after")
    def _file_exists(self):
        file = getattr(self, self.FILE)
        if file != self.BUILTIN and not Path(file).is_file():
            raise ValueError(f"{self.FILE} {file!r} does not exist; write it with `{self.CALIBRATE}`")
        return self

    def layout_why(self, head_size: int) -> str | None:
        """Why the format cannot store heads of ``head_size`` with these parameters, or None."""
        raise NotImplementedError

    def file_why(self, model: Any) -> str | None:
        """Why the file does not fit ``model`` (a ``ModelInfo``), or None; a ValueError if unreadable."""
        raise NotImplementedError

    def check_deployment(self, ctx: Any) -> list[str]:
        """At deployment validation (a ``DeploymentContext``): the layout against the model's head
        size; the file, unless the stand-in, against its layers, KV heads and head size."""
        model = ctx.model
        if model is None:
            return []
        out = []
        if model.head_size is not None and (why := self.layout_why(model.head_size)):
            out.append(f"cannot store the KV cache of model {model.path}: {why}")
        if getattr(self, self.FILE) != self.BUILTIN:
            try:
                why = self.file_why(model)
            except ValueError as e:
                why = str(e)
            if why:
                out.append(why)
        return out
