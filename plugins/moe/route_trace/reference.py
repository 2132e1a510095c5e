"""The route-trace scheduler: ``observe`` into a :class:`~.trace.Recorder`."""
from __future__ import annotations

import atexit
import os
from pathlib import Path
from typing import Any

from vllm_graft.hooks import MoEModel, MoEScheduler

from .trace import Recorder, Trace


class RouteTrace(MoEScheduler):
    def __init__(self, params) -> None:
        super().__init__(params)
        self.recorder = Recorder(params.max_tokens, params.weights)
        self.model: MoEModel | None = None
        if params.path:
            atexit.register(self._save_at_exit)

    def bind(self, model: MoEModel) -> None:
        self.model = model

    def observe(self, layer_idx, topk_ids, topk_weights):
        E = self.model.num_experts if self.model is not None else None
        self.recorder.add(layer_idx, topk_ids.detach().cpu().numpy(),
                          topk_weights.detach().float().cpu().numpy(), E)

    # ------------------------------------------------------------ for the tools
    def reset(self) -> None:
        self.recorder.reset()

    def trace(self, meta: dict[str, Any] | None = None) -> Trace:
        E = self.model.num_experts if self.model is not None else None
        info = {"model": self.model.model if self.model else None, **(meta or {})}
        return self.recorder.trace(E, info)

    def save(self, path: str | os.PathLike[str] | None = None) -> str:
        path = str(path or self.params.path)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.trace().save(path)
        return path

    def _save_at_exit(self) -> None:
        if self.recorder.tokens:
            try:
                self.save()
            except Exception:  # noqa: BLE001 - at exit there is no one to tell but stderr
                import traceback

                traceback.print_exc()

    def describe(self) -> dict[str, Any]:
        r = self.recorder
        return {"tokens_recorded": r.tokens, "steps": len(r._steps), "dropped_tokens": r.dropped}
