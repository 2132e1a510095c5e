"""The plugin manager: finds plugins, calls their registration hooks once, builds the registry.

Built-in and third-party plugins are found the same way, through the ``vllm_graft``
entry-point group (vllm-graft lists its own built-ins there, so this module never
imports ``vllm_graft.plugins``).

Environment:

``VLLM_GRAFT_PLUGINS``
    Comma-separated allow-list of entry-point names to load (default: all installed).
    Naming an entry point that is not installed is an error.
``VLLM_GRAFT_TRACE``
    ``1`` prints every hook call and its result to stderr (pluggy tracing).
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
import sys
import threading
from typing import Any, Iterable

import pluggy

from . import specs
from .kinds import HOOK_KINDS, Kind
from .registry import Registration, Registry, RegistryError, Source

logger = logging.getLogger("vllm_graft")

ENTRY_POINT_GROUP = "vllm_graft"
ENV_ALLOW = "VLLM_GRAFT_PLUGINS"
ENV_TRACE = "VLLM_GRAFT_TRACE"


class PluginLoadError(Exception):
    """A plugin could not be imported or its registration hook failed."""


def _env_allow_list() -> set[str] | None:
    raw = os.environ.get(ENV_ALLOW, "").strip()
    if not raw:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def _env_trace() -> bool:
    return os.environ.get(ENV_TRACE, "").strip().lower() in ("1", "true", "yes", "on")


class GraftPluginManager(pluggy.PluginManager):
    """pluggy's PluginManager plus provenance of each plugin and the registry build."""

    def __init__(self) -> None:
        super().__init__(specs.PROJECT)
        self.add_hookspecs(specs)
        self._sources: dict[str, Source] = {}

    # ---- discovery ---------------------------------------------------------------
    def load_entry_points(self, allow: Iterable[str] | None = None) -> list[str]:
        """Register every plugin of the ``vllm_graft`` entry-point group (or those in ``allow``)."""
        allow_set = set(allow) if allow is not None else None
        eps = list(md.entry_points(group=ENTRY_POINT_GROUP))
        if allow_set is not None:
            missing = sorted(allow_set - {ep.name for ep in eps})
            if missing:
                raise PluginLoadError(
                    f"{ENV_ALLOW} names {missing}, which no installed package provides; "
                    f"installed vllm_graft entry points: {sorted(ep.name for ep in eps)}"
                )
        loaded = []
        for ep in eps:
            if allow_set is not None and ep.name not in allow_set:
                logger.debug("skipping plugin %s: not in %s", ep.name, ENV_ALLOW)
                continue
            if self.has_plugin(ep.name):
                continue
            dist = ep.dist
            package = dist.metadata["Name"] if dist is not None else "?"
            version = dist.version if dist is not None else "?"
            try:
                plugin = ep.load()
            except Exception as e:  # a broken third-party plugin must say who it is
                raise PluginLoadError(
                    f"plugin {ep.name!r} (entry point {ep.value!r} of package {package} {version}) "
                    f"failed to import: {type(e).__name__}: {e}. Fix or uninstall that package, "
                    f"or leave it out with {ENV_ALLOW}=<names to load>"
                ) from e
            self.register(plugin, name=ep.name)
            self._sources[ep.name] = Source(package=package, version=version, plugin=ep.name)
            loaded.append(ep.name)
        return loaded

    def source_of(self, plugin_name: str, plugin: Any) -> Source:
        if plugin_name in self._sources:
            return self._sources[plugin_name]
        # Registered by hand (tests, notebooks): name the module it lives in.
        module = getattr(plugin, "__name__", None) or type(plugin).__module__
        version = str(getattr(plugin, "__version__", "-"))
        return Source(package=module, version=version, plugin=plugin_name)

    def enable_trace(self) -> None:
        self.trace.root.setwriter(sys.stderr.write)
        self.enable_tracing()

    # ---- the registry --------------------------------------------------------------
    def build_registry(self) -> Registry:
        """Call each registration hook once per plugin and collect what they register."""
        registry = Registry()
        plugins = self.list_name_plugin()
        for plugin_name, plugin in plugins:
            if plugin is None:  # blocked
                continue
            source = self.source_of(plugin_name, plugin)
            others = [p for _, p in plugins if p is not plugin and p is not None]
            for hook_name, kind in HOOK_KINDS.items():
                caller = self.subset_hook_caller(hook_name, remove_plugins=others)
                if not caller.get_hookimpls():
                    continue
                try:
                    caller(register=_register_callback(registry, kind, source))
                except RegistryError:
                    raise
                except Exception as e:
                    raise PluginLoadError(
                        f"{hook_name} of plugin {plugin_name!r} ({source.package}) failed: {type(e).__name__}: {e}"
                    ) from e
        return registry


def _register_callback(registry: Registry, kind: Kind, source: Source):
    def register(registration: Registration) -> None:
        if not isinstance(registration, Registration):
            raise RegistryError(
                f"plugin {source.plugin!r} ({source.package}) called register() with "
                f"{type(registration).__name__}; pass a vllm_graft.hooks.Registration"
            )
        if registration.kind is not None and registration.kind != kind:
            raise RegistryError(
                f"plugin {source.plugin!r} registered {registration.name!r} as kind "
                f"{registration.kind} from the {kind} hook; register it from the hook of its kind"
            )
        registry.add(registration.model_copy(update={"kind": kind}), source)

    return register


def make_plugin_manager(
    *, entry_points: bool = True, allow: Iterable[str] | None = None, trace: bool | None = None
) -> GraftPluginManager:
    """A fresh plugin manager; ``allow`` and ``trace`` default to the environment."""
    pm = GraftPluginManager()
    if trace if trace is not None else _env_trace():
        pm.enable_trace()
    if entry_points:
        pm.load_entry_points(allow if allow is not None else _env_allow_list())
    return pm


_lock = threading.Lock()
_cached: tuple[GraftPluginManager, Registry] | None = None


def get_plugin_manager() -> GraftPluginManager:
    """The process-wide plugin manager (entry points loaded once)."""
    return _get()[0]


def get_registry() -> Registry:
    """The process-wide registry, built once from every loaded plugin."""
    return _get()[1]


def _get() -> tuple[GraftPluginManager, Registry]:
    global _cached
    with _lock:
        if _cached is None:
            pm = make_plugin_manager()
            _cached = (pm, pm.build_registry())
        return _cached


def reset() -> None:
    """Forget the process-wide manager and registry (tests; after installing a plugin)."""
    global _cached
    with _lock:
        _cached = None
