"""The bridge into vLLM: the ``vllm.general_plugins`` entry point and deployment activation.

How a deployment reaches every vLLM process
-------------------------------------------
vLLM calls :func:`register` once in every process it starts (front end, engine core,
each worker; the CPU engine always spawns them). A deployment is given in one of two ways:

* ``--additional-config '{"graft": {...}}'`` / ``LLM(additional_config={"graft": ...})``;
* ``VLLM_GRAFT_DEPLOYMENT=deploy.yaml`` in the environment.

The front end resolves it when vLLM builds its config (:func:`_create_engine_config`, the
one wrapper installed in every front-end process): it validates the deployment with
:func:`.plan.plan_for` (a bad one fails here, before any engine process starts, with every
problem listed; an in-process engine started from an already validated plan gets that plan
back instead), activates it,
sets the engine arguments the plugins need (e.g. ``speculative_config``), and exports the
resolved deployment as ``VLLM_GRAFT_CONFIG`` so the engine-core and worker processes it
spawns activate the same one from :func:`register`.

With no deployment, nothing is registered, overridden or patched besides that wrapper,
which then only calls vLLM's own ``create_engine_config``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from typing import Any, Callable

from ..hooks import DeploymentError, Plan, Problem
from ..hooks.deployment import parse_json
from ..hooks.versions import SUPPORTED_VLLM, VLLM_BUILDS  # the adapters were checked against these

from .env import installed_vllm
from .lifetime import die_with_parent
from . import model_runner
from .patches import PATCHES, PatchError
from .plan import (
    ADDITIONAL_CONFIG_KEY,
    checkpoint_deployment,
    deployment_for_engine,
    deployment_json,
    graft_section,
    plan_adapters,
    plan_for,
)
from .targets import CREATE_ENGINE_CONFIG
from .runtime import ENV_REPORT_DIR, RUNTIME  # noqa: F401  ENV_REPORT_DIR: user-facing, beside the others

log = logging.getLogger("vllm_graft")

ENV_FILE = "VLLM_GRAFT_DEPLOYMENT"  # user-facing: a deployment YAML file
ENV_CONFIG = "VLLM_GRAFT_CONFIG"  # internal: the resolved deployment (JSON), for child processes
ENV_ACTIVATION_LOG = "VLLM_GRAFT_ACTIVATION_LOG"  # debugging aid: append one line per activation


class UnsupportedVLLMError(RuntimeError):
    pass


# ----------------------------------------------------------------------------- entry point
#: Set (to anything) to see the Python traceback under a deployment error that ends the process.
TRACEBACK_ENV = "VLLM_GRAFT_TRACEBACK"


def brief_on_exit(err: BaseException) -> None:
    """Should ``err`` (a deployment error about to leave vLLM's code) end the process uncaught,
    as it does under ``vllm serve``, print what is wrong, where and the fix (one line per problem)
    instead of Python's traceback; exit status 1 as before. Code that catches the error (an
    ``LLM(...)`` caller) sees nothing change. ``VLLM_GRAFT_TRACEBACK=1`` keeps the traceback."""
    if os.environ.get(TRACEBACK_ENV) or getattr(sys.excepthook, "graft_brief", False):
        return
    previous = sys.excepthook

    def hook(kind: Any, value: Any, tb: Any) -> None:
        seen: set[int] = set()
        chain = value
        while chain is not None and id(chain) not in seen:
            if isinstance(chain, DeploymentError):
                n = len(chain.problems)
                lines = [f"vllm-graft: {chain.source}: {n} problem{'s' if n != 1 else ''}, so vLLM did not start:"]
                lines += [f"  - {p}" for p in chain.problems]
                lines.append(f"(set {TRACEBACK_ENV}=1 to see the Python traceback)")
                print("\n".join(lines), file=sys.stderr)
                return
            seen.add(id(chain))
            chain = chain.__cause__ or chain.__context__
        previous(kind, value, tb)

    hook.graft_brief = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def register() -> None:
    """``vllm.general_plugins`` entry point: called by vLLM once per process; idempotent
    (``RUNTIME.registered``, which deactivation keeps)."""
    if RUNTIME.registered:
        return
    RUNTIME.registered = True
    try:
        _register()
    except DeploymentError as e:
        brief_on_exit(e)
        raise


def _register() -> None:
    die_with_parent()  # first: whatever follows may fail, and a launcher's child must still go with it
    _check_additional_config_argv(sys.argv)
    found = installed_vllm()
    data, source = _deployment_from_env()
    if found is not None and not _supported(found[1]):
        if data is not None:
            raise UnsupportedVLLMError(_unsupported_message(found))
        log.warning("vllm-graft: %s; no deployment given, so nothing is changed", _unsupported_message(found))
        return
    _install_config_hook()
    if data is not None:
        plan = plan_for(data, source=source)  # validated again in each process: see .plan
        activate(plan, source=source)


def _check_additional_config_argv(argv: list[str]) -> None:
    """vLLM calls :func:`register` while it builds its command line, before parsing it; a
    ``--additional-config`` carrying a deployment (it names ``graft``) that is not valid JSON
    is refused here, saying where the JSON breaks and how to quote it (vLLM's own message only
    says the value "cannot be converted to <function loads>")."""
    names = ("--additional-config", "--additional_config")
    for i, arg in enumerate(argv):
        if arg in names and i + 1 < len(argv):
            text = argv[i + 1]
        elif arg.split("=", 1)[0] in names and "=" in arg:
            text = arg.split("=", 1)[1]
        else:
            continue
        if "graft" not in text:
            continue
        try:
            json.loads(text)
        except ValueError as e:
            raise DeploymentError(
                [
                    Problem(
                        "--additional-config",
                        f"is not valid JSON: {e}",
                        value=text,
                        hint="write the deployment as one JSON object in single quotes for the shell, e.g. "
                        """--additional-config '{"graft": {"speculative": {"plugin": "lookahead"}}}', """
                        "or put it in a YAML file and set VLLM_GRAFT_DEPLOYMENT=FILE",
                    )
                ],
                "--additional-config",
            ) from None


def _supported(version: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return SpecifierSet(SUPPORTED_VLLM).contains(Version(version).base_version, prereleases=True)


def _unsupported_message(found: tuple[str, str]) -> str:
    from .env import package_version

    builds = ", ".join(
        f"{b.distribution} {b.minor}.* on {b.platform} (pip install 'vllm-graft[{b.extra}]')" for b in VLLM_BUILDS
    )
    return (
        f"vllm-graft {package_version()} supports vLLM {SUPPORTED_VLLM}, but {found[0]} "
        f"{found[1]} is installed. Install a supported build ({builds}) or a vllm-graft "
        "release made for this vLLM."
    )


def check_vllm_version() -> tuple[str, str]:
    """The installed vLLM, or a clear error when it is missing or unsupported."""
    found = installed_vllm()
    if found is None:
        raise UnsupportedVLLMError(
            "vLLM is not installed: pip install 'vllm-graft[cpu]' (CPU) or 'vllm-graft[gpu]' (GPU)"
        )
    if not _supported(found[1]):
        raise UnsupportedVLLMError(_unsupported_message(found))
    _warn_unchecked_build(found)
    return found


def _warn_unchecked_build(found: tuple[str, str]) -> None:
    """A release in the range whose build (distribution) no row of hooks/versions.py names:
    allowed, but said once (e.g. the CUDA build of 0.32: only the CPU build of 0.32 is checked)."""
    from packaging.version import Version

    release = Version(found[1]).release
    minor = f"{release[0]}.{release[1]}" if len(release) > 1 else found[1]
    if any(b.distribution == found[0] and b.minor == minor for b in VLLM_BUILDS) or not RUNTIME.once(
        ("unchecked build", found)
    ):
        return
    checked = ", ".join(f"{b.distribution} {b.minor}" for b in VLLM_BUILDS)
    log.warning(
        "vllm-graft: %s %s is in the supported range but its build was never checked "
        "(checked: %s); run `vllm-graft doctor` to see whether everything it needs is there",
        found[0],
        found[1],
        checked,
    )


# --------------------------------------------------------------------------- deployments
def _deployment_from_env() -> tuple[dict[str, Any] | None, str]:
    """The deployment given through the environment, if any (the resolved JSON a parent
    exported wins over a user's file: it is the same deployment, already resolved)."""
    text = os.environ.get(ENV_CONFIG)
    if text:
        return parse_json(text, source=ENV_CONFIG), ENV_CONFIG
    path = os.environ.get(ENV_FILE)
    if path:
        return {"__file__": path}, f"{ENV_FILE}={path}"
    return None, ""


# ----------------------------------------------------------------------------- activation
def activate(plan: Plan, *, source: str) -> None:
    """Make ``plan`` this process's deployment: each kind's adapter registers its plugins
    into vLLM. Activating the same deployment again does nothing; a different one first
    deactivates the current one."""
    check_vllm_version()
    text = deployment_json(plan)
    if RUNTIME.active:
        if RUNTIME.config_json == text:
            return
        deactivate()
    adapters = plan_adapters(plan)  # all found, or none run
    RUNTIME.plan, RUNTIME.source, RUNTIME.config_json = plan, source, text
    try:
        for adapter in adapters:
            adapter.activate(plan.by_kind(adapter.kind), plan, RUNTIME)
            RUNTIME.adapters.append(adapter)
    except BaseException:
        deactivate()
        raise
    names = ", ".join(f"{e.kind}:{e.name}" for e in plan.enabled) or "no plugins"
    log.info("vllm-graft: deployment from %s active in process %d (%s)", source, os.getpid(), names)
    _warn_reference_on_gpu(plan)
    _log_activation(source, plan)
    RUNTIME.start_reporting(os.environ.get(ENV_REPORT_DIR) or None)
    if RUNTIME.report_dir is not None:
        _install_report_shutdown_grace()


#: Seconds the engine core and its workers get to exit (and so write their last report, see
#: ``Runtime._flush_at_exit``) when a reporting front end stops them at vLLM's default
#: ``shutdown_timeout=0``; vLLM's own best-effort window when it is given none.
REPORT_SHUTDOWN_GRACE_S = 5.0


def _install_report_shutdown_grace() -> None:
    from .targets import REPORT_SHUTDOWN_GRACE

    try:
        PATCHES.apply(REPORT_SHUTDOWN_GRACE, _report_shutdown_grace)
    except PatchError as e:  # vLLM moved it: the reports may miss the last second, serving is unaffected
        if RUNTIME.once("report shutdown grace"):
            log.warning(
                "vllm-graft: %s; a stopped server's reports may miss its last second of events "
                "(start vLLM with --shutdown-timeout 5 to keep them)",
                e,
            )


def _report_shutdown_grace(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's engine-process shutdown timeout, at least :data:`REPORT_SHUTDOWN_GRACE_S` while
    this process reports (``VLLM_GRAFT_REPORT_DIR``). Only the processes' exit waits: vLLM's
    ``shutdown_timeout`` still decides how long requests drain (0: aborted at once), and the
    wait ends as soon as the processes are gone. Measured on vLLM's CPU engine (tiny model):
    the worker exited about 3 s after the SIGTERM, and the engine core stayed until the window
    ended and it was killed, so a reporting server's stop takes up to this window longer."""

    @functools.wraps(original)
    def timeout(request_timeout: float | None, process_timeout: float | None) -> float | None:
        got = original(request_timeout, process_timeout)
        # only an immediate abort (both 0) gains the window, as vLLM's ROCm window does: a 0 left
        # of a positive drain budget is vLLM's deadline, and None is already its own 5 s
        if RUNTIME.report_dir is not None and request_timeout == 0 and got == 0:
            return REPORT_SHUTDOWN_GRACE_S
        return got

    return timeout


def _warn_reference_on_gpu(plan: Plan) -> None:
    """On CUDA, say which plugins run their PyTorch reference (``kernel: reference``, the
    default of every plugin with Triton kernels) instead of their kernels: correct, but not
    what a GPU deployment wants, and nothing else would tell."""
    from vllm.platforms import current_platform

    from ..hooks import KERNEL_FIELD

    if not current_platform.is_cuda():
        return
    slow = [f"{e.kind}:{e.name}" for e in plan.enabled if getattr(e.params, KERNEL_FIELD, None) == "reference"]
    if slow:
        log.warning(
            "vllm-graft: %s run their plain-PyTorch reference on CUDA (kernel: reference, "
            "the default); set `kernel: triton` in each plugin's parameters for its Triton "
            "kernels",
            ", ".join(slow),
        )


def deactivate() -> None:
    """Undo every adapter's registrations and patches in this process, and forget the
    deployment's state: :meth:`.runtime.Runtime.reset`, which holds all of it."""
    RUNTIME.reset()


def _log_activation(source: str, plan: Plan) -> None:
    path = os.environ.get(ENV_ACTIVATION_LOG)
    if not path:
        return
    import multiprocessing

    line = {
        "pid": os.getpid(),
        "process": multiprocessing.current_process().name,
        "source": source,
        "plugins": [f"{e.kind}:{e.name}" for e in plan.enabled],
    }
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


# ------------------------------------------------------------------- the front-end wrapper
def _install_config_hook() -> None:
    from vllm.engine.arg_utils import EngineArgs

    if PATCHES.is_patched(EngineArgs, "create_engine_config"):
        return
    try:
        PATCHES.apply(CREATE_ENGINE_CONFIG, _create_engine_config, on=EngineArgs)
    except PatchError as e:  # pragma: no cover - vLLM moved the method
        raise UnsupportedVLLMError(str(e)) from e


def warn_kv_size_conflict(engine_args: Any) -> None:
    """Say (once per value) when ``VLLM_CPU_KVCACHE_SPACE`` and ``kv_cache_memory_bytes`` are both
    set on vLLM's CPU engine: its platform lets the variable win (vllm/platforms/cpu.py,
    check_and_update_config: ``cache_config.kv_cache_memory_bytes = space * GiB``), silently."""
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    given = getattr(engine_args, "kv_cache_memory_bytes", None)
    if not space or given is None:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    try:
        wins = int(space) << 30
    except ValueError:
        return  # vLLM itself refuses a non-integer value
    if wins != int(given) and RUNTIME.once(("kv size conflict", space, given)):
        log.warning(
            "vllm-graft: VLLM_CPU_KVCACHE_SPACE=%s overrides kv_cache_memory_bytes=%s on vLLM's CPU engine: "
            "the KV cache gets %s GiB (%d bytes), not the bytes asked for; unset VLLM_CPU_KVCACHE_SPACE "
            "to use kv_cache_memory_bytes, or drop kv_cache_memory_bytes",
            space,
            given,
            space,
            wins,
        )


def _create_engine_config(original):
    def create_engine_config(self, *args, **kwargs):
        try:
            return _graft_engine_config(original, self, *args, **kwargs)
        except DeploymentError as e:
            brief_on_exit(e)
            raise

    create_engine_config.__wrapped__ = original
    return create_engine_config


def _graft_engine_config(original, self, *args, **kwargs):
    """The bridge's part of vLLM's ``EngineArgs.create_engine_config``, then vLLM's own."""
    warn_kv_size_conflict(self)
    graft = graft_section(self.additional_config)
    if graft is not None:
        data, source = graft, "additional_config.graft"
        env_data, env_source = _deployment_from_env()
        if env_data is not None and env_source.startswith(ENV_FILE):
            raise DeploymentError(
                [
                    Problem(
                        "additional_config.graft",
                        f"a deployment is also given by {env_source}",
                        hint=f"give one deployment: unset {ENV_FILE} or drop additional_config.graft",
                    )
                ],
                source,
            )
    else:
        data, source = _deployment_from_env()
        if source == ENV_CONFIG and RUNTIME.source != ENV_CONFIG:
            data = None  # exported by us for an earlier engine in this process
    if data is None and checkpoint_deployment(self.model) is not None:
        # a checkpoint written by `vllm-graft quantize`: plan_for adds its quant plugin
        data, source = {}, f"{self.model}/config.json quantization_config"
    if data is None:
        if RUNTIME.active:
            deactivate()
        os.environ.pop(ENV_CONFIG, None)
        return original(self, *args, **kwargs)

    from ..hooks.deployment.validate import parallelism_in_use
    from ..hooks.registry import PARALLELISM

    used = parallelism_in_use({arg: getattr(self, arg, None) for arg in PARALLELISM.values()})
    flags = {PARALLELISM[mode]: value for mode, value in used.items()}
    dtype = getattr(self, "dtype", None)  # vLLM's --dtype: what the plugins' dtype checks must see
    if dtype is not None and str(dtype) != "auto":
        flags["dtype"] = str(dtype).removeprefix("torch.")
    # an in-process engine started from a plan gets that plan back, not validated again
    plan = plan_for(data, source=source, engine_model=self.model, engine_args=flags)
    activate(plan, source=source)
    try:
        _apply_engine_overrides(self, plan)
    except BaseException:
        deactivate()
        raise
    warn_kv_size_conflict(self)  # the deployment's engine section may have set the bytes
    text = deployment_json(plan)
    os.environ[ENV_CONFIG] = text
    if not isinstance(self.additional_config, dict):
        self.additional_config = {}
    self.additional_config[ADDITIONAL_CONFIG_KEY] = json.loads(text)
    try:  # Model Runner V1 where a patch needs it (see .runner)
        decision = model_runner.before_config(PATCHES.applied(), model_runner.plugins_by_owner(plan.enabled))
        config = original(self, *args, **kwargs)
        model_runner.after_config(config, decision)
    except BaseException:
        deactivate()
        raise
    return config


def _apply_engine_overrides(engine_args: Any, plan: Plan) -> None:
    """Set the engine arguments the deployment's plugins need (and its ``engine`` section)
    on vLLM's EngineArgs; a conflicting value the user set is an error, not overwritten."""
    wanted: dict[str, Any] = dict(plan.deployment.engine)
    why: dict[str, str] = {}  # the adapters' reasons, by engine argument
    for adapter in plan_adapters(plan):
        overrides = adapter.engine_overrides(plan.by_kind(adapter.kind), plan)
        wanted.update(overrides)
        why.update(
            {
                k: f"{adapter.kind.value} plugins need {k}={overrides[k]!r}: {w}"
                for k, w in getattr(adapter, "engine_why", {}).items()
                if k in overrides
            }
        )
    problems = []
    defaults = _engine_defaults()
    for key, value in wanted.items():
        if key in why and key in plan.deployment.engine and plan.deployment.engine[key] != value:
            problems.append(
                Problem(
                    f"engine.{key}",
                    why[key],
                    value=plan.deployment.engine[key],
                    accepted=repr(value),
                    hint=f"drop {key} from the deployment's engine section, or leave the plugin out",
                )
            )
            continue
        if not hasattr(engine_args, key) and key in why:
            continue  # this vLLM build has no such argument (nothing to turn off)
        current = getattr(engine_args, key, None)
        if current == value:
            continue
        if key in defaults and current != defaults[key] and current is not None:
            problems.append(
                Problem(
                    f"engine.{key}",
                    why.get(key, "the deployment needs a different value than vLLM was started with"),
                    value=current,
                    accepted=repr(value),
                    hint=f"drop --{key.replace('_', '-')} from the vLLM command line",
                )
            )
            continue
        setattr(engine_args, key, value)
        if key in why and RUNTIME.once(("engine why", why[key])):
            log.warning("vllm-graft: %s set for this engine because %s", f"{key}={value!r}", why[key])
    if problems:
        raise DeploymentError(problems, "deployment vs vLLM engine arguments")


def _engine_defaults() -> dict[str, Any]:
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    out = {}
    for f in dataclasses.fields(EngineArgs):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            try:
                out[f.name] = f.default_factory()
            except Exception:
                pass
    return out


__all__ = [
    "register",
    "activate",
    "deactivate",
    "graft_section",
    "check_vllm_version",
    "deployment_for_engine",
    "ENV_FILE",
    "ENV_CONFIG",
    "SUPPORTED_VLLM",
]
