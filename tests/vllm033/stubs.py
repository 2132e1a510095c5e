"""Recorders for the kernels vLLM 0.33's backends call, bound against the real signatures."""
from __future__ import annotations

import inspect
from typing import Any, Callable


class Recorder:
    """Stands for ``real``: each call is bound against ``inspect.signature(real)`` (a call the
    real function would refuse raises TypeError here too), recorded as ``(name, arguments)``,
    and answered by ``answer(arguments)``."""

    def __init__(self, name: str, real: Callable, calls: list, answer: Callable[[dict], Any] | None = None):
        self.name, self.real, self.calls, self.answer = name, real, calls, answer
        self.signature = inspect.signature(real)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        self.calls.append((self.name, dict(bound.arguments)))
        return self.answer(bound.arguments) if self.answer is not None else None


def stub(monkeypatch, module: Any, name: str, calls: list, answer: Callable[[dict], Any] | None = None) -> Recorder:
    """Replace ``module.name`` (the backend module's own binding of a kernel) by a Recorder."""
    real = getattr(module, name)
    rec = Recorder(name, real, calls, answer)
    monkeypatch.setattr(module, name, rec)
    return rec


def fill_out(arguments: dict) -> Any:
    """A kernel writing into ``out``: zeros there (the stock path's values are not checked)."""
    out = arguments.get("out")
    if out is not None:
        out.zero_()
    return out


class RecordedClass:
    """Base of a stand-in for a kernel wrapper class (FlashInfer's ``Batch*Wrapper``): its
    ``__init__`` and every method called bind against the real class's, and are recorded."""

    real: type
    calls: list

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        Recorder(f"{self.real.__name__}.__init__", self.real.__init__, self.calls)(self, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        real = getattr(self.real, name)  # AttributeError for what the real class lacks
        if not callable(real):
            return real
        answer = _fill_first_out
        if name == "plan":  # FlashInfer's plan() keeps what it planned as _<parameter> (its
            # wrappers do, e.g. decode.py:2471-2474; vLLM's forward asserts them)

            def answer(arguments: dict, wrapper: Any = self) -> None:
                for k, v in arguments.items():
                    if k != "self":
                        object.__setattr__(wrapper, "_" + k, v)

        rec = Recorder(f"{self.real.__name__}.{name}", real, self.calls, answer)
        return lambda *a, **k: rec(self, *a, **k)


def _fill_first_out(arguments: dict) -> Any:
    out = arguments.get("out")
    if out is not None:
        out.zero_()
    return out


def recorded_class(real: type, calls: list) -> type:
    return type(f"Recorded{real.__name__}", (RecordedClass,), {"real": real, "calls": calls})


class CopyPageIndices:
    """FlashInfer's ``_copy_page_indices_kernel[(num_reqs,)](page_indices, block_table,
    block_table_stride, cu_num_blocks, BLOCK_SIZE=...)`` (0.33 flashinfer.py:2959-2980) in torch:
    each request's first pages, from its block-table row into the packed page list."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def __getitem__(self, grid: tuple) -> Callable:
        def launch(page_indices, block_table, block_table_stride, cu_num_blocks, BLOCK_SIZE):
            self.calls.append(("_copy_page_indices_kernel", {"grid": grid}))
            bounds = cu_num_blocks.cpu().tolist()  # a kernel reads these on the device
            for r in range(grid[0]):
                a, b = bounds[r], bounds[r + 1]
                page_indices[a:b] = block_table[r, : b - a]

        return launch
