"""A fake CUDA device for CPU tests: catches mixed devices and counts host syncs.

vLLM hands a plugin its tensors on the GPU (query, KV cache, block tables, weights, router
logits); a tensor the plugin makes without ``device=`` lands on the host, and on CUDA the
first op that mixes the two raises (or, for a host tensor indexed by a device one, raises
too). The CPU engine cannot show this: there every tensor is on the host. Neither can it
show a host sync (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``): free on the CPU, a
stall of the GPU stream on CUDA, and a failure inside a captured CUDA graph.

:class:`FakeDevice` is a :class:`torch.overrides.TorchFunctionMode` that keeps the data on
the CPU but *marks* the tensors that would be on the device:

* tensors given to :meth:`FakeDevice.put` (what vLLM would hand the plugin), and tensors
  a factory call makes whose caller is one of ``inputs_from`` (a test harness that stands
  for vLLM: its inputs are device inputs);
* every result of an op with a marked input (views, arithmetic, ``zeros_like``...), and
  every tensor made with ``device=`` the fake device (``torch.zeros(n, device=q.device)``,
  ``x.to(q.device)``, ``x.cuda()``): a marked tensor reports ``device`` ``cuda:0`` and
  ``is_cuda`` True, so device-generic code takes its CUDA path.

Then an op that mixes a marked tensor with an unmarked host tensor of one or more
dimensions raises :class:`DeviceMixError` naming the op and where it was called, as CUDA
would (a 0-dim host tensor is allowed, as on CUDA; ``copy_``/``to`` move data across, and a
device tensor may be indexed by a host index, which CUDA copies over). An op whose CUDA
kernel refuses inputs the CPU one takes (:data:`CUDA_LIMITS`: ``torch._int_mm`` below 17 rows
or with columns not a multiple of 8) raises :class:`CudaLimitError` on device inputs, with
CUDA's message. Each host sync on a
marked tensor is recorded as a :class:`Sync` (what and where), attributed to the innermost
:meth:`FakeDevice.region` (e.g. the plugin method being called), so a test can assert a
hot path has none and a report can say how many a step or a layer costs.

Nothing here needs vLLM or a GPU. With ``GRAFT_REAL_DEVICE=cuda`` (the GPU check command),
:func:`device_under_test` gives a real CUDA device instead and the suites run on it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from collections import Counter
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.overrides import TorchFunctionMode

#: What a marked tensor says it is on.
FAKE = torch.device("cuda", 0)
#: Environment variable: a real device to run the device suites on instead (``cuda``).
ENV_REAL = "GRAFT_REAL_DEVICE"

_HERE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))

#: Ops whose output lives on the host whatever the input (their results are not marked).
_TO_HOST = {
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "numpy",
    "cpu",
    "__array__",
    "__format__",
    "__repr__",
    "equal",
    "allclose",
}
#: Ops that read a device tensor's values on the host (only counted for marked tensors): those,
#: and the ops whose output's size depends on the values.
_SYNC_METHODS = _TO_HOST | {"nonzero", "unique", "unique_consecutive", "masked_select", "argwhere"}
#: Tensor properties a marked tensor answers as a CUDA tensor would.
_PROPS = {"device": lambda: FAKE, "is_cuda": lambda: True, "is_cpu": lambda: False}


class DeviceMixError(AssertionError):
    """An op mixed a (fake) device tensor with a host tensor: it would fail on CUDA."""


class CudaLimitError(RuntimeError):
    """An op was called on (fake) device tensors with inputs its CUDA kernel refuses (a shape,
    dtype or layout the CPU kernel accepts): it would raise on CUDA, so it raises here."""


def _int_mm_limits(args: tuple, kwargs: dict) -> str | None:
    # PyTorch's CUDA torch._int_mm (aten/src/ATen/native/cuda/Blas.cpp, _int_mm_out_cuda): cuBLASLt
    # int8 needs more than 16 rows and multiples of 8 in both inner and output columns
    a = args[0] if args else kwargs.get("self")
    b = args[1] if len(args) > 1 else kwargs.get("mat2")
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None
    if a.dim() != 2 or b.dim() != 2:
        return f"expected 2-D inputs, got {a.dim()}-D and {b.dim()}-D"
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        return f"expected int8 inputs, got {a.dtype} and {b.dtype}"
    if a.size(0) <= 16:
        return f"self.size(0) needs to be greater than 16, but got {a.size(0)}"
    if a.size(1) % 8:
        return f"self.size(1) needs to be greater than 0 and a multiple of 8, but got {a.size(1)}"
    if b.size(1) % 8:
        return f"mat2.size(1) needs to be greater than 0 and a multiple of 8, but got {b.size(1)}"
    return None


#: Ops whose CUDA kernel refuses inputs the CPU kernel takes: name -> a check of (args, kwargs)
#: returning what CUDA would say, or None. Applied when any input is on the (fake) device.
CUDA_LIMITS: dict[str, Callable[[tuple, dict], str | None]] = {"_int_mm": _int_mm_limits}


@dataclass(frozen=True)
class Sync:
    op: str  # e.g. "item", "tolist", "__bool__", "cpu", "nonzero"
    where: str  # "file:line" of the caller outside torch
    region: str  # the innermost FakeDevice.region() when it happened ("" outside any)


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "") or ""
    if name == "__get__":  # a property getter: the attribute's name
        return "get:" + getattr(getattr(func, "__self__", None), "__name__", "")
    return name.split(".")[0]  # OpOverload names: "add.Tensor" -> "add"


def _is_fake(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True  # a CUDA ordinal
    try:
        return torch.device(device).type == "cuda"
    except (RuntimeError, TypeError):
        return False


def _is_host(device: Any) -> bool:
    try:
        return device is not None and not isinstance(device, int) and torch.device(device).type == "cpu"
    except (RuntimeError, TypeError):
        return False


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o, depth + 1)


def caller() -> str:
    """``file:line`` of the innermost frame outside torch and this module."""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        fn = os.path.abspath(f.f_code.co_filename)
        if fn != _HERE and not fn.startswith(_TORCH_DIR) and "contextlib" not in fn:
            return f"{fn}:{f.f_lineno}"
        f = f.f_back
    return "?"


class FakeDevice(TorchFunctionMode):
    """Use as ``with FakeDevice(inputs_from=[harness_dir]) as fd: ...`` (see the module doc).

    ``inputs_from``: files or folders whose factory calls make device tensors (the harness
    that plays vLLM); the syncs made there are the harness's own and are not recorded."""

    def __init__(self, inputs_from: Iterable[str] = ()) -> None:
        super().__init__()
        self._marked: dict[int, weakref.ref] = {}
        self.inputs_from = tuple(os.path.abspath(p) for p in inputs_from)
        self.syncs: list[Sync] = []
        self._regions: list[str] = []
        self.calls: Counter[str] = Counter()  # region name -> times entered

    # ------------------------------------------------------------------ marking
    def is_marked(self, t: Any) -> bool:
        r = self._marked.get(id(t)) if isinstance(t, torch.Tensor) else None
        return r is not None and r() is t

    def _mark(self, obj: Any) -> Any:
        for t in _tensors(obj):
            key = id(t)

            def forget(_r: Any, key: int = key, m: dict[int, weakref.ref] = self._marked) -> None:
                m.pop(key, None)

            self._marked[key] = weakref.ref(t, forget)
        return obj

    def put(self, *tensors: Any) -> Any:
        """Mark ``tensors`` (the same objects) as on the device; returns them (one: itself)."""
        for t in tensors:
            self._mark(t)
        return tensors[0] if len(tensors) == 1 else tensors

    # ------------------------------------------------------------------ regions and syncs
    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Attribute the syncs inside to ``name`` (nested: the innermost wins)."""
        self._regions.append(name)
        self.calls[name] += 1
        try:
            yield
        finally:
            self._regions.pop()

    def wrap(self, obj: Any, methods: Iterable[str], prefix: str = "") -> list[str]:
        """Replace ``obj``'s bound ``methods`` (those it has) by ones that run inside a region of
        their name; returns the names wrapped."""
        done = []
        for m in methods:
            f = getattr(obj, m, None)
            if not callable(f):
                continue

            def wrapped(*a, __f=f, __n=prefix + m, **k):
                with self.region(__n):
                    return __f(*a, **k)

            setattr(obj, m, wrapped)
            done.append(m)
        return done

    def _sync(self, op: str) -> None:
        where = caller()
        if self.inputs_from and where.startswith(self.inputs_from):
            return  # the harness reading its own results
        self.syncs.append(Sync(op, where, self._regions[-1] if self._regions else ""))

    def sync_counts(self) -> dict[str, int]:
        """``{region: syncs}`` recorded so far."""
        return dict(Counter(s.region for s in self.syncs))

    def report(self) -> dict[str, dict[str, Any]]:
        """Per region entered: ``calls``, ``syncs``, ``per_call`` and the distinct places
        (``op at file:line``) the syncs came from."""
        out: dict[str, dict[str, Any]] = {}
        for name, calls in self.calls.items():
            mine = [s for s in self.syncs if s.region == name]
            out[name] = {
                "calls": calls,
                "syncs": len(mine),
                "per_call": round(len(mine) / calls, 2),
                "where": sorted({f"{s.op} at {_short(s.where)}" for s in mine}),
            }
        return out

    # ------------------------------------------------------------------ the mode
    def _from_inputs(self, args: tuple, kwargs: dict) -> bool:
        """A factory call (no tensor in) made by the harness: what vLLM would hand the plugin.
        Only factories walk the stack: every other op's result follows its inputs."""
        return (
            bool(self.inputs_from)
            and next(_tensors((args, kwargs)), None) is None
            and caller().startswith(self.inputs_from)
        )

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None):
        kwargs = dict(kwargs or {})
        name = _name(func)
        # pinned host memory needs a CUDA runtime: a pinned buffer is an ordinary host buffer here
        # (its data and its copies behave the same), so the pinned branches of vLLM and of the
        # adapters run on the fake device as they would on CUDA
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if name == "pin_memory":
            return args[0]
        if name.startswith("get:"):
            prop = name[4:]
            if prop in _PROPS and args and self.is_marked(args[0]):
                return _PROPS[prop]()
            if prop in ("data", "T", "mT", "H", "mH", "real", "imag", "grad"):
                out = func(*args, **kwargs)
                return self._mark(out) if args and self.is_marked(args[0]) else out
            return func(*args, **kwargs)

        marked_in = [t for t in _tensors((args, kwargs)) if self.is_marked(t)]
        # where the result goes: an explicit device, else the inputs'
        target = kwargs.get("device")
        if name in ("to", "cuda", "cpu", "type_as") or target is not None:
            target = self._target(name, args, kwargs)
        if _is_fake(target):
            kwargs = self._host_kwargs(name, args, kwargs)
            args = self._host_args(name, args)
            out = func(*args, **kwargs)
            return self._mark(out)
        to_host = _is_host(target) or name in _TO_HOST
        if marked_in:
            if name in _SYNC_METHODS or (to_host and name == "to"):
                self._sync(name)
            elif name == "__getitem__" and _bool_index(args):
                self._sync("__getitem__[bool mask]")
            elif (
                name == "repeat_interleave"
                and "output_size" not in kwargs
                and (
                    isinstance(kwargs.get("repeats"), torch.Tensor)
                    or isinstance(args[0], torch.Tensor)
                    and (len(args) < 2 or isinstance(args[1], torch.Tensor))
                )
            ):
                self._sync(name)  # tensor repeats: the output size is read on the host
            self._check_mix(name, args, kwargs)
            limit = CUDA_LIMITS.get(name)
            refused = limit(args, kwargs) if limit is not None else None
            if refused:
                raise CudaLimitError(
                    f"torch.{name} on CUDA: {refused} (at {caller()}); the CPU kernel accepts this, "
                    "CUDA's does not: pad the inputs or take another path on CUDA"
                )
            out = func(*args, **kwargs)
            if to_host:  # the same object when the data is already here: a new, unmarked one
                return out.view_as(out) if isinstance(out, torch.Tensor) and self.is_marked(out) else out
            if name in ("copy_", "__setitem__") and args and not self.is_marked(args[0]):
                self._sync(f"{name} (device to host)")
                return out
            return self._mark(out)
        out = func(*args, **kwargs)
        if target is None and self._from_inputs(args, kwargs):
            self._mark(out)
        return out

    def _target(self, name: str, args: tuple, kwargs: dict) -> Any:
        if name == "cuda":
            return FAKE
        if name == "cpu":
            return torch.device("cpu")
        if name == "type_as":
            return FAKE if len(args) > 1 and self.is_marked(args[1]) else None
        if "device" in kwargs:
            return kwargs["device"]
        if name == "to":
            for a in args[1:]:
                if isinstance(a, torch.Tensor):
                    return FAKE if self.is_marked(a) else torch.device("cpu")
                if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
                    return a
        return None

    @staticmethod
    def _host_kwargs(name: str, args: tuple, kwargs: dict) -> dict:
        if "device" in kwargs:
            kwargs["device"] = "cpu"
        kwargs.pop("non_blocking", None) if name == "cuda" else None
        return kwargs

    def _host_args(self, name: str, args: tuple) -> tuple:
        if name == "to":
            out = [args[0]]
            for a in args[1:]:
                if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool) and _is_fake(a):
                    out.append(torch.device("cpu"))
                elif isinstance(a, torch.Tensor) and self.is_marked(a):
                    out.append(a.dtype)  # to(other): other's dtype, on the host
                else:
                    out.append(a)
            return tuple(out)
        if name == "cuda":
            return args[:1]
        return args

    def _check_mix(self, name: str, args: tuple, kwargs: dict) -> None:
        host = [t for t in _tensors((args, kwargs)) if not self.is_marked(t) and t.dim() > 0]
        if not host:
            return
        if name in ("copy_", "to", "cpu", "cuda", "type_as"):
            return
        if name == "__getitem__" and self.is_marked(args[0]):
            return  # device[host index]: CUDA copies the index over
        if name == "__setitem__" and self.is_marked(args[0]):
            index = args[1] if len(args) > 1 else None
            value = args[2] if len(args) > 2 else None
            if not any(True for _ in _tensors(index)) or not (
                isinstance(value, torch.Tensor) and not self.is_marked(value) and value.dim() > 0
            ):
                return  # basic slicing (a copy), or a host index with a device value
        shapes = ", ".join(
            f"{'device' if self.is_marked(t) else 'HOST'} {tuple(t.shape)} {t.dtype}" for t in _tensors((args, kwargs))
        )
        raise DeviceMixError(
            f"{name}() mixes a device tensor with a host tensor of {tuple(host[0].shape)} ({shapes}) at "
            f"{caller()}: on CUDA this raises (or, indexed, fails). Create the host tensor on the "
            "device of the tensors you were given (device=query.device), or move it there once "
            "when it is built."
        )


def _bool_index(args: tuple) -> bool:
    idx = args[1] if len(args) > 1 else None
    return any(t.dtype == torch.bool for t in _tensors(idx))


def _short(where: str) -> str:
    for marker in ("/vllm_graft/", "/main/", "/site-packages/"):
        if marker in where:
            return where.split(marker, 1)[1]
    return where


def device_under_test() -> torch.device | None:
    """A real device named by ``GRAFT_REAL_DEVICE`` (e.g. ``cuda`` on the GPU check machine),
    or None: use :class:`FakeDevice`."""
    real = os.environ.get(ENV_REAL)
    return torch.device(real) if real else None


__all__ = [
    "FakeDevice",
    "DeviceMixError",
    "CudaLimitError",
    "CUDA_LIMITS",
    "Sync",
    "FAKE",
    "ENV_REAL",
    "device_under_test",
    "caller",
]
