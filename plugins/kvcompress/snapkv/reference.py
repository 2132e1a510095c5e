"""SnapKV at block granularity (see ``__init__``): the observation window's mass under the keep
policy over the prompt's blocks (``hooks.contracts.kvpolicy``); attention and mass from the
worker's shared attention with per-block mass (``kvcompress/_shared``), as H2O's."""

from vllm_graft.hooks import WindowMass


class SnapKV(WindowMass):
    pass
