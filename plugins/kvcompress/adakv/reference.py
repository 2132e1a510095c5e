"""Ada-KV at block granularity, per KV head (see ``__init__``): SnapKV's window scores per KV
head under the keep policy with ``allocation: heads`` (``hooks.contracts.kvpolicy``: the blocks
each head keeps, ``keep_heads``, and their union, ``keep``); the per-head masked attention with
per-head mass is the worker's shared one (``kvcompress/_shared``)."""

from vllm_graft.hooks import WindowMass


class AdaKV(WindowMass):
    per_head = True
    allocation = "heads"
