"""PyramidKV at block granularity, per decoder layer (see ``__init__``): SnapKV's window scores per
layer under the keep policy with ``allocation: layers`` (``hooks.contracts.kvpolicy``: the blocks
each layer keeps, ``keep_layers``, and their union, ``keep``); the per-layer masked attention with
per-layer mass is the worker's shared one (``kvcompress/_shared``)."""

from vllm_graft.hooks import WindowMass


class PyramidKV(WindowMass):
    per_layer = True
    allocation = "layers"
