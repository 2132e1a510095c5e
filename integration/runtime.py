"""Per-process state of the active deployment: the plugin instances and what they did.

Every vLLM process (front end, engine core, workers) activates the deployment on its own
(see :mod:`vllm_graft.integration.bridge`) and so has its own :data:`RUNTIME`. With the
in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, what `vllm-graft demo` and
`bench` use) they are all one process, so :meth:`Runtime.report` sees every plugin.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Hashable, Iterator, TypeVar

from ..hooks import Kind, Plan, contract_for
from ..hooks.deployment import Enabled

from .patches import PATCHES, PatchRegistry


log = logging.getLogger("vllm_graft")

#: Where each process writes what its plugins did (see :meth:`Runtime.write_report`).
ENV_REPORT_DIR = "VLLM_GRAFT_REPORT_DIR"
#: A process rewrites its report at most this often, and only when events were counted since.
REPORT_EVERY_S = 1.0


class PluginContractError(TypeError):
    """A plugin's implementation does not implement the contract of its kind."""


@dataclass
class Seams:
    """What the active adapters plug into the attention backend (:mod:`.adapters.backend`'s
    ``SEAMS``; vLLM-free, so it lives here, on the runtime)."""

    # attention plugin: (method instance, plugin name, count function)
    method: Any = None
    method_name: str = ""
    #: the method computes plain attention (``AttentionMethod.uses_host_kernel``): vLLM's own
    #: cache write and kernel run every layer, and the method is not called
    host_kernel: bool = False
    count: Callable[[str, int], None] | None = None
    # KV compression: spec hook and metadata rewriters (applied in order)
    customize_spec: Callable[[Any], Any] | None = None
    rewriters: list[Callable[[Any, Any], Any]] = field(default_factory=list)
    # KV storage format: an object with write(key, value, kv_cache, slot_mapping) and
    # forward(query, kv_cache, batch, layer) -> out (see kvcompress._FormatSeam)
    kv_format: Any = None
    owners: set[str] = field(default_factory=set)
    #: the generic backend's exact PyTorch attention, used while no attention plugin is enabled
    #: (``adapters.custom_backend``; built on first use, per deployment)
    reference_attention: Any = None
    route: str = ""  # the backend classes registered, ";"-joined (see install)
    installed: list[Any] = field(default_factory=list)  # the enum members overridden

    def clear(self) -> None:
        """Every field back to its default (the object stays: the backend holds it)."""
        fresh = Seams()
        for f in fields(self):
            setattr(self, f.name, getattr(fresh, f.name))


S = TypeVar("S")


@dataclass
class Runtime:
    plan: Plan | None = None
    source: str | None = None  # where the deployment came from (for messages)
    config_json: str | None = None  # the resolved deployment, as passed to child processes
    instances: dict[tuple[Kind, str], Any] = field(default_factory=dict)  # contract instances (see instance)
    #: the parameters each of :attr:`instances` was built from (an instance placed by hand has none)
    instance_params: dict[tuple[Kind, str], Any] = field(default_factory=dict, repr=False)
    events: Counter = field(default_factory=Counter)  # (kind, name, event) -> count
    adapters: list[Any] = field(default_factory=list)  # activated, in order
    report_dir: str | None = None  # VLLM_GRAFT_REPORT_DIR at activation
    _dirty: bool = False  # events counted since the last report
    #: this worker's tensor-parallel rank, once vLLM has set it up (kept: vLLM tears its groups
    #: down at shutdown, before the last report is written at exit)
    _tp_rank: int | None = None
    _reporter: threading.Thread | None = field(default=None, repr=False)
    _flush_registered: bool = field(default=False, repr=False)
    #: adapter-side objects holding per-request tables (:meth:`track_state`), by label
    state_holders: dict[str, Any] = field(default_factory=dict, repr=False)
    _last_sizes: dict[str, int] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # ---- the adapters' state of the active deployment (:meth:`reset` clears it). The adapters
    # keep it here, on the process's :data:`RUNTIME`, and nowhere else (tests/unit/
    # test_runtime_state.py holds them to it), whatever runtime ``activate`` is handed: each
    # kind's in one typed dataclass of its adapter's, ``adapter_state[kind]`` (:meth:`kind_state`).
    #: :mod:`.model_runner` set ``VLLM_USE_V2_MODEL_RUNNER=0`` for this deployment (undone at reset)
    runner_env_set: bool = False
    #: what was said once since the last reset (see :meth:`once`)
    said: set = field(default_factory=set, repr=False)
    #: what :meth:`reset` calls (with this runtime) to undo what a deployment changed outside
    #: vLLM's registries and the patches (:meth:`at_reset`; e.g. the model runner's variable)
    _at_reset: list[Callable[["Runtime"], None]] = field(default_factory=list, repr=False)

    # ---- process-lifetime state (:meth:`reset` keeps it)
    #: the patch registry whose adapter patches :meth:`reset` undoes (:data:`RUNTIME`'s is
    #: :data:`.patches.PATCHES`; a runtime made apart, e.g. in a test, undoes none)
    patches: PatchRegistry | None = field(default=None, repr=False)
    #: the ``vllm.general_plugins`` entry point ran in this process (``bridge.register``: once per
    #: process, like the front-end config hook it installs, which deactivation leaves in place)
    registered: bool = False
    #: the attention backend's seams (what the attention and kvcompress adapters plug in)
    seams: Seams = field(default_factory=Seams, repr=False)
    #: each adapter's per-deployment state (``Adapter.state``, :meth:`kind_state`: kind -> its
    #: ``State``: the kvcompress adapter's active compressor, the speculative one's tree verifier,
    #: the MoE adapter's chain, the quant adapter's registered methods)
    adapter_state: dict[Kind, Any] = field(default_factory=dict, repr=False)
    #: the plan this process last validated, with the environment and registry it was
    #: validated against (:func:`.plan.plan_for` hands it to an in-process engine instead of
    #: validating again); kept through reset, as a plan does not depend on what is active
    validated: tuple[Any, Any, Any] | None = field(default=None, repr=False)
    #: the quant adapter's linear methods by key, for its custom ops (``adapters.quant.tensors``):
    #: weak, so an engine's methods go with its model; they belong to the model, not to the
    #: deployment, and the keys baked into a compiled graph are never reused in a process
    linear_methods: "weakref.WeakValueDictionary[int, Any]" = field(
        default_factory=weakref.WeakValueDictionary, repr=False
    )
    linear_keys: Iterator[int] = field(default_factory=itertools.count, repr=False)
    #: metadata builds and layer forwards through the generic backend (``adapters.custom_backend``)
    #: in this process, by ``"build"``/``"forward"``: tests read the difference across a run
    backend_calls: Counter = field(default_factory=Counter, repr=False)

    @property
    def active(self) -> bool:
        return self.plan is not None

    def kind_state(self, kind: Kind, state_class: Callable[[], S]) -> S:
        """The per-deployment state of ``kind``'s adapter, a ``state_class`` (made on first use)."""
        state = self.adapter_state.get(kind)
        if state is None:
            state = self.adapter_state[kind] = state_class()
        return state

    def enabled(self, kind: Kind) -> list[Enabled]:
        return self.plan.by_kind(kind) if self.plan else []

    def instance(self, enabled: Enabled) -> Any:
        """The process's one instance of an enabled plugin, built on first use: an instance of
        its kind's contract (checked when built; typed Any, as the contract depends on the kind).
        An instance built from other parameters (one a check made outside any deployment, e.g.
        :func:`.adapters.speculative.tree.drafts_trees` on another plan, left behind) is built
        anew: a deployment never runs a plugin configured for another one."""
        key = (enabled.kind, enabled.name)
        with self._lock:
            impl = self.instances.get(key)
            built_from = self.instance_params.get(key, enabled.params)
            if impl is not None and built_from is not enabled.params and built_from != enabled.params:
                impl = None
            if impl is None:
                cls = enabled.entry.registration.load()
                contract = contract_for(enabled.kind, enabled.entry.registration.capabilities.role)
                if not (isinstance(cls, type) and issubclass(cls, contract)):
                    raise PluginContractError(
                        f"{enabled.kind} plugin {enabled.name!r}: impl "
                        f"{enabled.entry.registration.impl!r} must be a subclass of "
                        f"vllm_graft.hooks.{contract.__name__} (from package {enabled.entry.source.package})"
                    )
                impl = cls(enabled.params)
                self.instances[key] = impl
                self.instance_params[key] = enabled.params
            return impl

    def count(self, kind: Kind, name: str, event: str, n: int = 1) -> None:
        """Record that plugin ``name`` did ``event`` (n times): the proof it was reached."""
        self.events[(Kind(kind), name, event)] += n
        self._dirty = True
        if self._tp_rank is None and self.report_dir is not None:
            self._tensor_parallel_rank()  # while a plugin runs vLLM's groups are up (not at exit)

    def start_reporting(self, folder: str | None) -> None:
        """Report to ``folder`` (None: not at all): written now, then by a daemon thread every
        :data:`REPORT_EVERY_S` when events were counted since (the hot path only sets a flag)."""
        self.report_dir = folder
        if folder is None:
            return
        self.write_report()
        if self._reporter is None or not self._reporter.is_alive():

            def loop() -> None:
                while self.report_dir is not None:
                    time.sleep(REPORT_EVERY_S)
                    try:
                        sizes = self.state_sizes()
                        if self._dirty or sizes != self._last_sizes:
                            self._dirty = False
                            self.write_report(sizes)
                    except RuntimeError as e:
                        # the engine's thread changed a table while this one read it ("dictionary
                        # changed size during iteration", e.g. in a plugin's describe()): it would
                        # end this thread and freeze the report; the next period reads again
                        self._dirty = True
                        log.debug("vllm-graft: plugin report not written this period (%s); retrying", e)

            self._reporter = threading.Thread(target=loop, name="vllm-graft-report", daemon=True)
            self._reporter.start()
            self._flush_at_exit()

    def _flush_at_exit(self) -> None:
        """Write the last second's events when this process ends, however Python ends it:
        ``atexit`` in a main process, and multiprocessing's own exit finalizers in the engine
        core and the workers. vLLM starts those as ``multiprocessing`` processes; a forked one
        leaves through ``os._exit``, which runs no ``atexit`` handler, only those finalizers
        (``BaseProcess._bootstrap``). vLLM's SIGTERM handlers raise SystemExit, so a process that
        is told to stop reaches them too. Before this, a server stopped within a report period of
        its last request lost the worker's last events (issue 64: 1136 of /metrics' 1196
        verified). Only SIGKILL escapes: vLLM sends it to a worker still alive 4 s after its
        SIGTERM."""
        if self._flush_registered:
            return
        self._flush_registered = True
        import atexit
        import multiprocessing.util

        atexit.register(self._final_report)
        # exitpriority: run by multiprocessing's _exit_function (a child's last step, and an
        # atexit handler of the main process: _final_report writes once, the second finds it clean)
        multiprocessing.util.Finalize(None, self._final_report, exitpriority=100)

    def _final_report(self) -> None:
        """At process exit: the events of the last second (see :meth:`_flush_at_exit`)."""
        if self._dirty:
            self._dirty = False
            self.write_report()

    def write_report(self, sizes: dict[str, int] | None = None) -> None:
        """Write :meth:`report` to ``<report_dir>/<process>-<pid>.json`` (replaced atomically):
        how a server's user sees what the plugins did in vLLM's engine and worker processes
        (``vllm-graft report DIR`` adds them up). Written at activation, then (see
        :meth:`start_reporting`) within :data:`REPORT_EVERY_S` of events being counted. A failed write is logged once and
        turns the report off; serving goes on."""
        if self.report_dir is None:
            return
        import multiprocessing

        process = multiprocessing.current_process().name
        path = os.path.join(self.report_dir, f"{process}-{os.getpid()}.json")
        try:
            os.makedirs(self.report_dir, exist_ok=True)
            state_sizes = self.state_sizes() if sizes is None else sizes
            data = {
                "pid": os.getpid(),
                "process": process,
                "source": self.source,
                "tensor_parallel_rank": self._tensor_parallel_rank(),
                "written_at": time.time(),
                "plugins": self.report(),
                "state_sizes": state_sizes,
            }
            self._last_sizes = state_sizes
            # a temporary file per writing thread: the reporter thread and a final or requested
            # report may write at once, and two writers of one temporary file interleave (a
            # report with a shorter one's text over its start: "Extra data" to a JSON reader)
            tmp = f"{path}.{threading.get_ident()}.tmp"
            with open(tmp, "w") as f:
                json.dump(data, f, default=str)
            os.replace(tmp, path)
        except OSError as e:
            log.warning(
                "vllm-graft: cannot write the plugin report to %s (%s); %s is ignored from now on",
                path,
                e,
                ENV_REPORT_DIR,
            )
            self.report_dir = None

    def _tensor_parallel_rank(self) -> int | None:
        if self._tp_rank is None:
            self._tp_rank = _tensor_parallel_rank()
        return self._tp_rank

    def counts(self, kind: Kind, name: str) -> dict[str, int]:
        # list(): one C-level copy under the GIL, so the reporter thread never iterates a Counter
        # the engine's thread is adding a key to
        return {ev: c for (k, nm, ev), c in list(self.events.items()) if k == Kind(kind) and nm == name}

    def report(self) -> list[dict[str, Any]]:
        """Per enabled plugin: its parameters, the events counted in this process, and
        what its implementation says it did (``describe()``)."""
        out = []
        for e in self.plan.enabled if self.plan else []:
            impl = self.instances.get((e.kind, e.name))
            out.append(
                {
                    "kind": str(e.kind),
                    "name": e.name,
                    "params": e.params.model_dump(mode="json"),
                    "events": self.counts(e.kind, e.name),
                    "described": impl.describe() if impl is not None else {},
                    "instantiated": impl is not None,
                }
            )
        return out

    def track_state(self, label: str, holder: Any) -> None:
        """Have :meth:`state_sizes` look into ``holder`` (an adapter object holding per-request
        tables) under ``label``. Read only; the holder is kept for the process's life."""
        self.state_holders[label] = holder

    def state_sizes(self) -> dict[str, int]:
        """Entries per request-keyed table of this process: each dict with string keys (vLLM's
        request ids are strings) found on a plugin instance or a :meth:`track_state` holder, or on
        their vllm_graft attributes two levels down, as ``"kind/name.attr[.attr]": len``. Tables
        empty or keyed otherwise (layers, token ids) are left out. What `vllm-graft soak` reads from
        the reports to see per-request state return to its start after a drain."""
        out: dict[str, int] = {}
        roots = [(f"{k}/{n}", impl) for (k, n), impl in list(self.instances.items())]
        for label, obj in roots + list(self.state_holders.items()):
            _request_tables(obj, label, out, depth=2, seen=set())
        return out

    def fresh_cross_request_state(self) -> list[str]:
        """Renew (``Proposer.fresh_drafting_state``: by default ``__init__`` again with the same
        parameters) each speculative plugin instance whose drafts draw on state shared across
        requests (not ``per_request_drafts``),
        so that a timed run of the bench or demo, which repeat the same prompts, does not draft
        from the previous run's outputs. One given the target's weights (``needs_target_weights``)
        is kept as it is, said in a log line. Returns the names rebuilt."""
        renewed = []
        for (kind, name), impl in list(self.instances.items()):
            if kind != Kind.SPECULATIVE or getattr(impl, "per_request_drafts", False):
                continue
            if getattr(impl, "needs_target_weights", False):
                log.info(
                    "vllm-graft: speculative plugin %r keeps its state between timed runs (it holds "
                    "the target's weights); its later runs may draft from earlier runs' outputs",
                    name,
                )
                continue
            impl.fresh_drafting_state()
            renewed.append(name)
        return renewed

    def once(self, key: Hashable) -> bool:
        """True the first time ``key`` is asked since the last :meth:`reset` (then False): for
        what is said once per deployment (``if RUNTIME.once(("why", why)): log.warning(...)``)."""
        if key in self.said:
            return False
        self.said.add(key)
        return True

    def at_reset(self, undo: Callable[["Runtime"], None]) -> None:
        """Have :meth:`reset` call ``undo(self)`` (once however often asked; last asked, first called)."""
        if undo not in self._at_reset:
            self._at_reset.append(undo)

    def reset(self) -> None:
        """Deactivation, in one call: each activated adapter's ``deactivate`` (last first), the
        adapters' patches undone (:data:`.patches.PATCHES`; the bridge's own config hook stays),
        what :meth:`at_reset` was asked to undo (:mod:`.model_runner`'s variable), then every
        per-deployment field cleared. What stays is the process-lifetime state (``registered``,
        the linear methods, the backend calls)."""
        for adapter in reversed(self.adapters):
            adapter.deactivate()
        if self.patches is not None:  # every adapter's patches; the bridge's config hook stays
            from .targets import CREATE_ENGINE_CONFIG

            for owner in dict.fromkeys(p.owner for p in self.patches.applied()):
                if owner != CREATE_ENGINE_CONFIG.owner:
                    self.patches.undo(owner)
        while self._at_reset:
            self._at_reset.pop()(self)
        self.plan = self.source = self.config_json = self.report_dir = self._tp_rank = None  # ends the reporter
        self._dirty = False
        self.instances.clear()
        self.instance_params.clear()
        self.events.clear()
        self.adapters.clear()
        self.state_holders.clear()
        self._last_sizes = None
        self.seams.clear()
        self.adapter_state.clear()
        self.runner_env_set = False
        self.said.clear()


def _request_tables(obj: Any, label: str, out: dict[str, int], depth: int, seen: set[int]) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    try:
        attrs = list(vars(obj).items())
    except TypeError:  # no __dict__ (slots, builtins)
        return
    for name, value in attrs:
        if isinstance(value, dict):
            try:
                keys = list(value)  # the engine thread may be changing it
            except RuntimeError:
                continue
            if keys and all(isinstance(k, str) for k in keys):
                out[f"{label}.{name}"] = len(keys)
        elif depth > 1 and type(value).__module__.startswith("vllm_graft."):
            _request_tables(value, f"{label}.{name}", out, depth - 1, seen)


def write_report_now(*_worker: Any) -> None:
    """Write this process's plugin report now. The reporter thread writes within
    :data:`REPORT_EVERY_S` of new events, and at a normal exit; vLLM's multiprocess executor
    ends its worker processes without one, so a run shorter than that can lose a worker's last
    events (seen at two ranks: a worker's report kept only what it had at activation). Before
    shutting an ``LLM`` down, ``llm.collective_rpc(write_report_now)`` writes every worker's
    (vLLM calls it with the worker as argument; it sends a function only with
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``)."""
    if RUNTIME.report_dir is not None:
        RUNTIME.write_report()


def _tensor_parallel_rank() -> int | None:
    """This process's rank in vLLM's tensor-parallel group; None outside a worker (front end,
    engine core) or where vLLM is not loaded."""
    import sys

    if "vllm.distributed.parallel_state" not in sys.modules:
        return None
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized

    return get_tensor_model_parallel_rank() if model_parallel_is_initialized() else None


#: This process's runtime: the one object holding the active deployment's state (the plugin
#: instances, what they did, the adapters' state); ``bridge.deactivate`` is its :meth:`~Runtime.reset`.
RUNTIME = Runtime(patches=PATCHES)
