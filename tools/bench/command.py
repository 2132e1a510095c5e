"""`vllm-graft bench DEPLOYMENT`: the command line and the parent side of a bench run: build
the workloads, start each arm in its own spawned process (:mod:`.arm`), have the arms take
turns run by run (:func:`run_arms`), assemble, render and write the result. ``--suite``
hands over to :mod:`.suite`."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.markup import escape

from .arm import _arm_main
from .report import PLOT_INSTALL, new_progress, plot_available, render_report, write_plot
from .stats import ARMS, NO_PACKAGE, arm_order, assemble, cpu_isa

from ...launch.exits import EXIT_DIFFERENT, EXIT_INVALID, EXIT_OK, EXIT_USAGE
from ...launch.exits import EXIT_FAILED as EXIT_RUN_FAILED


# ===================================================================== the parent side
class ArmFailed(RuntimeError):
    def __init__(self, arm: str, message: str, log_path: str, error_type: str | None = None) -> None:
        super().__init__(message)
        self.arm, self.log_path, self.error_type = arm, log_path, error_type


class ArmProcess:
    """One arm in a spawned child process (:func:`.arm._arm_main`) that loads its engine once and
    then runs what it is told: :meth:`run_round` (every workload once) any number of times,
    then :meth:`finish` (scoring, result). Events go to ``on_event`` while the parent waits."""

    def __init__(
        self,
        job: dict[str, Any],
        workdir: Path,
        on_event: Callable[[str, str, Any], None],
        timeout: float | None = None,
        turn: Any = None,
    ) -> None:
        import multiprocessing

        self.job, self.on_event, self.timeout = job, on_event, timeout
        self.result_path = str(workdir / f"{job['arm']}.json")
        ctx = multiprocessing.get_context("spawn")
        self._events, sender = ctx.Pipe(duplex=False)
        receiver, self._commands = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=_arm_main,
            args=(job, self.result_path, sender, receiver, turn),
            name=f"vllm-graft-bench-{job['arm']}",
        )
        self.proc.start()
        sender.close()  # the child holds the only write end: EOF when it exits
        receiver.close()
        self.started = time.monotonic()

    def _pump(self, until: str | None) -> None:
        """Pass events on until one of kind ``until`` arrives (None: until the child exits)."""
        while not self.poll(until, wait=0.2):
            pass

    def poll(self, until: str | None, wait: float = 0.0) -> bool:
        """Pass on the events that have come (waiting up to ``wait`` s for one); True once one of
        kind ``until`` has come, or, with ``until`` None, once the child has exited."""
        arm = self.job["arm"]
        while self._events.poll(wait):
            wait = 0.0
            try:
                who, kind, payload = self._events.recv()
            except EOFError:
                return self._exited(until)
            if until is not None and kind == until:
                return True
            if kind not in ("ready", "round_done"):
                self.on_event(who, kind, payload)
        if not self.proc.is_alive() and not self._events.poll(0):
            return self._exited(until)
        if self.timeout and time.monotonic() - self.started > self.timeout:
            self.close()
            raise ArmFailed(arm, f"timed out after {self.timeout:.0f} s", self.job["log_path"])
        return False

    def _exited(self, until: str | None) -> bool:
        self.proc.join(60)  # the result is on disk once the pipe is closed; a stuck teardown is ended below
        self.close()
        if until is not None:  # it exited before saying what was waited for: its result says why
            self._read()
            raise ArmFailed(
                self.job["arm"],
                f"the process exited with code {self.proc.exitcode} before {until}",
                self.job["log_path"],
            )
        return True

    def _read(self) -> dict[str, Any]:
        if not os.path.exists(self.result_path):
            raise ArmFailed(
                self.job["arm"],
                f"the process exited with code {self.proc.exitcode} and wrote no result",
                self.job["log_path"],
            )
        with open(self.result_path) as f:
            result = json.load(f)
        if "error" in result:
            raise ArmFailed(self.job["arm"], result["error"], self.job["log_path"], result.get("error_type"))
        return result

    def _send(self, command: str, payload: Any) -> None:
        try:
            self._commands.send((command, payload))
        except (BrokenPipeError, OSError):
            self._pump(None)
            self._read()
            raise ArmFailed(self.job["arm"], "the process is gone", self.job["log_path"])

    def wait_ready(self) -> None:
        self._pump("ready")

    def run_round(self, index: int) -> None:
        self.begin_round(index)
        self._pump("round_done")

    def begin_round(self, index: int) -> None:
        """Start a round and return at once (``--interleave step``: both arms run it, in turns)."""
        self._send("run", index)

    def round_done(self) -> bool:
        """After :meth:`begin_round`: whether the round is over (not waiting)."""
        return self.poll("round_done")

    def finish(self, score: dict[str, Any] | None = None) -> dict[str, Any]:
        self._send("finish", score or {})
        self._pump(None)
        return self._read()

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)
        for conn in (self._events, self._commands):
            conn.close()


def run_arms(
    jobs: dict[str, dict[str, Any]],
    order: list[list[str]],
    *,
    start: Callable[..., Any],
    score_for_plain: Callable[[dict[str, Any]], dict[str, Any]],
    scorer_job: dict[str, Any] | None = None,
    score_all: Callable[[dict[str, dict[str, Any]]], dict[str, Any]] | None = None,
    turns: Any = None,
) -> tuple[dict[str, dict[str, Any]], dict | None]:
    """Drive the arms: start each arm's process in the order of the first run (one at a time:
    the next starts once the previous is warm, so engine loads do not overlap), run every
    round in its order (``order[r]``: the arms take turns, alternating), then finish the graft
    arm, then plain, which scores the graft arm's outputs (``score_for_plain(graft result)``)
    and its own. ``scorer_job``: a plain engine that only scores (when plain did not generate,
    or ran a deployment as is): what ``score_all(results)`` gives it, else the graft arm's outputs.
    ``start(job)`` returns an :class:`ArmProcess` (or a stand-in). ``turns`` (a :class:`.turns.Turns`,
    ``--interleave step``): both arms run each round at once, step by step in turns, ``order[r][0]``
    taking the first; ``start(job, side)`` then. Returns the generating arms' raw results and the scores."""
    procs: dict[str, Any] = {}
    results: dict[str, dict[str, Any]] = {}
    scores = None
    sides = {arm: i for i, arm in enumerate(order[0])}
    if turns is not None and len(sides) != 2:
        raise ValueError(f"--interleave step takes two arms, not {', '.join(order[0])}")
    try:
        for arm in order[0]:
            procs[arm] = start(jobs[arm]) if turns is None else start(jobs[arm], turns.side(sides[arm]))
            procs[arm].wait_ready()
        for r, arms in enumerate(order):
            if turns is None:
                for arm in arms:
                    procs[arm].run_round(r)
            else:
                _run_in_turns(procs, arms, r, turns, sides)
        for arm in [a for a in ("graft", "plain") if a in procs]:
            extra = score_for_plain(results["graft"]) if arm == "plain" and "graft" in results else {}
            results[arm] = procs.pop(arm).finish(extra)
            if "scores" in results[arm]:
                scores = results[arm]["scores"]
        if scorer_job is not None:
            proc = procs["plain-scorer"] = start(scorer_job)
            proc.wait_ready()
            payload = score_all(results) if score_all else score_for_plain(results["graft"])
            raw = procs.pop("plain-scorer").finish(payload)
            scores = raw.get("scores")
    finally:
        for proc in procs.values():
            proc.close()
    return results, scores


def _run_in_turns(procs: dict[str, Any], arms: list[str], r: int, turns: Any, sides: dict[str, int]) -> None:
    """One round of ``--interleave step``: the first turn to ``arms[0]``, both arms started, then
    watched together until both are done (an arm that fails is seen at once, not after the other
    arm, which would wait for its turn forever)."""
    turns.start_round(sides[arms[0]])
    for arm in arms:
        procs[arm].begin_round(r)
    waiting = list(arms)
    while waiting:
        waiting = [arm for arm in waiting if not procs[arm].round_done()]
        if waiting:
            time.sleep(0.05)


def pool_runs(first: dict[str, dict[str, Any]], second: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Two pairs of arm processes' raw results as one: each workload's runs (``repeats``) are the
    first pair's then the second's (paired ratios pair run r of one arm with run r of the other,
    in the same pair and round); the requests shown, the engine and the scores are the first
    pair's; the runs count as identical only if the pairs' greedy outputs are too."""
    pooled = {}
    for arm, raw in first.items():
        other = second[arm]
        workloads = {}
        for name, w in raw["workloads"].items():
            o = other["workloads"][name]
            same = [r["output_token_ids"] for r in w["requests"]] == [r["output_token_ids"] for r in o["requests"]]
            workloads[name] = {
                **w,
                "repeats": list(w.get("repeats") or []) + list(o.get("repeats") or []),
                "repeats_identical": bool(
                    w.get("repeats_identical", True) and o.get("repeats_identical", True) and same
                ),
            }
        pooled[arm] = {**raw, "workloads": workloads}
    return pooled


def _parse_arms(text: str) -> list[str]:
    arms = []
    for part in text.split(","):
        part = part.strip()
        if part not in ARMS:
            raise ValueError(f"unknown arm {part!r}; accepted: {', '.join(ARMS)} (comma list)")
        if part not in arms:
            arms.append(part)
    if not arms:
        raise ValueError(f"no arm named; accepted: {', '.join(ARMS)}")
    return arms


def _baseline(plan: Any, baseline: str | None) -> tuple[Any, dict[str, str]]:
    """What the plain arm runs: ``(plan whose plain twin it is, environment)``. ``None``: the
    deployment's own twin. A deployment file: that file's twin (same model). ``no-package``:
    the deployment's twin with vLLM told, through ``VLLM_PLUGINS``, to load every general
    plugin except vllm-graft's (what installing the package costs)."""
    if baseline is None:
        return plan, {}
    if baseline == NO_PACKAGE:
        from importlib.metadata import entry_points

        others = sorted({e.name for e in entry_points(group="vllm.general_plugins")} - {"vllm_graft"})
        return plan, {"VLLM_PLUGINS": ",".join(others)}  # "" matches no plugin, as vLLM parses it
    from ...integration.plan import plan_for

    base = plan_for(baseline)
    mine = plan.model.path if plan.model is not None else plan.deployment.model
    theirs = base.model.path if base.model is not None else base.deployment.model
    if str(Path(str(mine)).resolve()) != str(Path(str(theirs)).resolve()):
        raise ValueError(f"{baseline} runs {theirs}, the deployment {mine}: the baseline must run the same model")
    if _max_model_len(base) < _max_model_len(plan):
        raise ValueError(
            f"{baseline} allows {_max_model_len(base)} tokens per sequence, the "
            f"deployment {_max_model_len(plan)}: the workloads would not fit it"
        )
    return base, {}


def _max_model_len(plan: Any) -> int:
    value = plan.deployment.engine.get("max_model_len")
    if value:
        return int(value)
    if plan.model is not None:
        cfg = json.loads((Path(plan.model.path) / "config.json").read_text())
        for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
            if cfg.get(key):
                return int(cfg[key])
    return 2048


def _tail(path: str, n: int = 25) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def cmd_bench(args: argparse.Namespace, console: Console) -> int:
    from .. import workloads as W

    out = Console(stderr=True, highlight=False, width=console.width) if args.json == "-" else console
    err = Console(stderr=True, highlight=False, width=console.width)

    if args.list_workloads:
        for w in W.WORKLOADS.values():
            out.print(f"[bold]{w.name}[/]: {escape(w.summary)}\n  {escape(w.describe)}")
        return EXIT_OK
    if getattr(args, "suite", None):
        from .suite import cmd_suite

        return cmd_suite(args, out, err, run_bench=run_bench, add_command=add_command)
    if not args.deployment:
        err.print(
            "[bold red]error:[/] give a deployment file: vllm-graft bench DEPLOYMENT.yaml "
            "(or a suite: vllm-graft bench --suite FILE)"
        )
        return EXIT_USAGE
    if args.plot and not plot_available():
        err.print(
            f"[bold red]error:[/] --plot needs matplotlib, which is not installed: {escape(PLOT_INSTALL)} "
            "(no engine started)"
        )
        return EXIT_USAGE
    rc, result = run_bench(args, out, err)
    if result is None:
        return rc
    render_report(result, out)
    if args.json:
        text = json.dumps(result, indent=1, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
            out.print(f"JSON written to {escape(args.json)}")
    if args.plot:
        write_plot(result, args.plot)
        out.print(f"plot written to {escape(args.plot)}")
    wall = result["wall_s"]
    out.print(
        f"[dim]bench wall time {wall:.1f} s; engine logs in {escape(str(args.log_dir))}[/]"
        if args.log_dir
        else f"[dim]bench wall time {wall:.1f} s[/]"
    )
    cmp = result["comparison"]
    if args.require_identical and cmp is not None and not cmp["identical"]:
        return EXIT_DIFFERENT
    return EXIT_OK


@dataclass
class _Inputs:
    """What a bench run is made of, validated before any engine starts (:func:`_inputs`)."""

    arms: list[str]
    names: list[str]
    plan: Any
    plain_plan: Any
    plain_env: dict[str, str]
    max_model_len: int
    tokenizer: Any
    prompt_sets: list[Any]


def _inputs(args: argparse.Namespace, err: Console) -> tuple[int, _Inputs | None]:
    """Validate the command line, the deployment, the baseline and the workloads: (EXIT_OK,
    inputs), or (the exit code, None) with the reason printed on ``err``."""
    from .. import workloads as W

    try:
        arms = _parse_arms(args.arms)
        names = W.parse_names(args.workload)
    except ValueError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}")
        return EXIT_USAGE, None
    if getattr(args, "interleave", None) is None:  # the default: step where two arms generate
        args.interleave = "step" if len(arms) == 2 else "run"
    elif args.interleave == "step" and len(arms) != 2:
        err.print("[bold red]error:[/] --interleave step runs two arms in turns: give --arms plain,graft")
        return EXIT_USAGE, None
    if min(args.num_prompts, args.max_tokens, args.repeat, getattr(args, "pairs", 1)) < 1 or args.batch < 0:
        err.print(
            "[bold red]error:[/] --num-prompts, --max-tokens, --repeat and --pairs must be at least 1, --batch at least 0"
        )
        return EXIT_USAGE, None

    from ...hooks import DeploymentError
    from ...integration.bridge import check_vllm_version
    from ...integration.plan import plan_for

    check_vllm_version()  # no vLLM (or an unsupported one): say so before reading any model
    try:
        plan = plan_for(args.deployment)
    except DeploymentError as e:
        n = len(e.problems)
        err.print(f"[bold red]✗ {escape(e.source)}: {n} problem{'s' if n != 1 else ''}[/] (no engine started)")
        for p in e.problems:
            err.print(f"  [red]•[/] {escape(str(p))}")
        return EXIT_INVALID, None
    if getattr(args, "baseline_as_is", False) and args.baseline in (None, NO_PACKAGE):
        err.print(
            "[bold red]error:[/] --baseline-as-is needs --baseline OTHER.yaml: the deployment file the "
            "plain arm runs with its plugins"
        )
        return EXIT_USAGE, None
    try:
        plain_plan, plain_env = _baseline(plan, args.baseline)
    except DeploymentError as e:
        err.print(f"[bold red]✗ baseline {escape(e.source)}: {escape(str(e.problems[0]))}[/] (no engine started)")
        return EXIT_INVALID, None
    except ValueError as e:
        err.print(f"[bold red]error:[/] --baseline: {escape(str(e))}")
        return EXIT_USAGE, None

    max_model_len = _max_model_len(plan)
    try:
        model = plan.model.path if plan.model is not None else plan.deployment.model
        if model is None:
            raise W.WorkloadError("the deployment names no model (model: FOLDER)")
        try:
            tokenizer = W.Tokenizer.from_model(model)
        except (OSError, ValueError, ImportError) as e:
            err.print(f"[bold red]error:[/] cannot load the tokenizer of {escape(str(model))}: {escape(str(e))}")
            return EXIT_INVALID, None
        prompt_sets = W.build(
            names,
            tokenizer,
            num_prompts=args.num_prompts,
            max_tokens=args.max_tokens,
            max_model_len=max_model_len,
            seed=args.seed,
        )
    except W.WorkloadError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}")
        return EXIT_USAGE, None
    return EXIT_OK, _Inputs(arms, names, plan, plain_plan, plain_env, max_model_len, tokenizer, prompt_sets)


class _Bars:
    """The run's progress bars on a rich Progress (the suite's, or one of its own): one per arm
    process, a second for its perplexity scoring, fed by the arm's events (:meth:`start`)."""

    def __init__(self, progress: Any, out: Console) -> None:
        self.owned = progress is None
        self.progress = progress or new_progress(out)
        self.totals: dict[Any, int] = {}
        self.added: list[Any] = []

    def on_events(self, label: str) -> Callable[[str, str, Any], None]:
        progress, totals = self.progress, self.totals
        task = progress.add_task(f"{label}: starting", total=None, unit="tokens")
        self.added.append(task)
        score_task: list[Any] = []

        def on_event(who: str, kind: str, payload: Any) -> None:
            if kind == "phase":
                progress.update(task, description=f"{label}: {payload}")
                if payload == "done" and task in totals:  # EOS can end requests early
                    progress.update(task, completed=totals[task])
            elif kind == "total":
                totals[task] = payload
                progress.update(task, total=payload)
            elif kind == "advance":
                progress.advance(task, payload)
            elif kind == "total_score":
                if task in totals:  # generation done (fewer tokens than budgeted at EOS)
                    progress.update(task, completed=totals[task])
                score_task.append(progress.add_task(f"{label}: perplexity", total=payload, unit="sequences"))
                self.added.append(score_task[0])
            elif kind == "advance_score" and score_task:
                progress.advance(score_task[0], payload)

        return on_event

    def __enter__(self) -> "_Bars":
        if self.owned:
            self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.owned:
            self.progress.stop()
        else:
            for task in self.added:
                self.progress.remove_task(task)


def _settings(args: argparse.Namespace, inputs: _Inputs, order: list[Any]) -> dict[str, Any]:
    return {
        "arms": inputs.arms,
        "baseline": args.baseline,
        "baseline_as_is": bool(getattr(args, "baseline_as_is", False)),
        "workloads": inputs.names,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "batch": args.batch,
        "repeat": args.repeat,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "max_model_len": inputs.max_model_len,
        "perplexity": not args.no_ppl,
        "temperature": 0.0,
        "order": order,
        "pairs": _pairs_of(args, inputs.arms),
        "interleave": getattr(args, "interleave", "run"),
    }


def _pairs_of(args: argparse.Namespace, arms: list[str]) -> int:
    """How many pairs of engine processes run the rounds (--pairs; one where there is one arm)."""
    return getattr(args, "pairs", 1) if len(arms) == 2 else 1


def _plan_info(plan: Any) -> dict[str, Any]:
    return {
        "model": plan.deployment.model,
        "plugins": [f"{e.kind}:{e.name}" for e in plan.enabled],
        "engine_args": plan.deployment.engine,
    }


def _environment(plan: Any) -> dict[str, Any]:
    from ...integration.env import installed_vllm
    from .. import workloads as W

    found = installed_vllm()
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_isa": cpu_isa(),  # vLLM's CPU kernels differ by ISA: a ratio holds for its ISA
        # the OpenMP runtime the arms inherit (vLLM's libiomp5 or torch's libgomp: speeds differ)
        "ld_preload": os.environ.get("LD_PRELOAD") or None,
        "vllm": f"{found[0]} {found[1]}" if found else None,
        "stdlib": str(W.stdlib_dir()),
        "vllm_platform": plan.platform,
    }


def _outputs_of(arm: str, raw: dict[str, Any], prompt_sets: Any) -> dict[str, Any]:
    """One arm's (prompt ids, output ids) by request, keyed as the scorer keys them."""
    return {
        f"{arm}/{ps.name}/{p.index}": (list(p.token_ids), r["output_token_ids"])
        for ps in prompt_sets
        for p, r in zip(ps.prompts, raw["workloads"][ps.name]["requests"])
    }


def _arm_failed(e: ArmFailed, err: Console) -> int:
    """Say which arm failed, with its log's last lines; the exit code."""
    err.print(f"[bold red]✗ the {e.arm} arm failed:[/] {escape(str(e))}")
    tail = _tail(e.log_path)
    if tail:
        err.print(f"[dim]last lines of {escape(e.log_path)}:[/]\n{escape(tail)}")
    err.print(f"full log: {escape(e.log_path)}")
    return EXIT_INVALID if e.error_type == "DeploymentError" else EXIT_RUN_FAILED


def _workload_jobs(prompt_sets: list[Any]) -> tuple[list[dict[str, Any]], dict[str, list[list[int]]]]:
    """The arms' workloads as their job gets them (name, prompts' token ids and max_tokens), and
    each workload's prompt ids by name."""
    jobs = [
        {"name": ps.name, "prompts": [{"token_ids": list(p.token_ids), "max_tokens": p.max_tokens} for p in ps.prompts]}
        for ps in prompt_sets
    ]
    return jobs, {ps.name: [list(p.token_ids) for p in ps.prompts] for ps in prompt_sets}


def _turns_of(args: argparse.Namespace) -> Callable[[], Any]:
    """What makes each pair of arm processes' baton: a :class:`.turns.Turns` with ``--interleave
    step`` (two arms, checked by :func:`_inputs`), None with ``run``."""
    if getattr(args, "interleave", "run") != "step":
        return lambda: None
    import multiprocessing

    from .turns import Turns

    return lambda: Turns(multiprocessing.get_context("spawn"))


#: ``--interleave step``: the OpenMP runtimes' spin before an idle thread sleeps (each unless set)
STEP_SPIN = {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "0"}


def _arm_threads(args: argparse.Namespace) -> tuple[dict[str, str], str]:
    """The arms' model threads (the environment they start with, a line saying so): torch's default, or
    as many as vLLM's CPU worker gets (``VLLM_CPU_OMP_THREADS_BIND``). With ``--interleave step``
    an arm's idle OpenMP threads must not spin through the other arm's turn: GNU OpenMP (the
    libgomp torch's CPU wheel loads, and vLLM preloads) spins 300,000 times before it sleeps (a SmolLM2
    fp32 A/A on a 2-core AVX2 VM: 11.0 tok/s per arm, 15.3 with ``GOMP_SPINCOUNT=10000``, 12.3 in a
    later run with it: the gain is not established); Intel OpenMP (an ``LD_PRELOAD``ed libiomp5)
    spins 200 ms (``KMP_BLOCKTIME``).
    Each is set unless the user set it; a runtime ignores the other's variable."""
    from ...integration.env import cpu_worker_threads

    env, line = cpu_worker_threads()
    if getattr(args, "interleave", "run") == "step":
        spin = {k: os.environ.get(k, v) for k, v in STEP_SPIN.items()}
        env = {**spin, **env}
    return env, line


def run_bench(
    args: argparse.Namespace, out: Console, err: Console, progress: Any = None
) -> tuple[int, dict[str, Any] | None]:
    """Validate, run both arms and assemble the result (no rendering): (exit code, result or
    None when it failed; the reason is printed on ``err``). ``progress``: a running
    rich Progress to add this run's bars to (the suite's); otherwise one of its own."""
    code, inputs = _inputs(args, err)
    if inputs is None:
        return code, None
    from ...launch.engine import llm_kwargs

    plan, prompt_sets = inputs.plan, inputs.prompt_sets
    as_is = bool(getattr(args, "baseline_as_is", False))
    wl_jobs, by_name = _workload_jobs(prompt_sets)
    # Per-request stats on (the cross-check of TTFT/ITL); the seed unless the deployment sets one.
    overrides = {"disable_log_stats": False, **({} if "seed" in plan.deployment.engine else {"seed": args.seed})}
    keep_logs = args.log_dir is not None
    workdir = Path(args.log_dir) if keep_logs else Path(tempfile.mkdtemp(prefix="vllm-graft-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)

    threads = _arm_threads(args)
    t_start = time.perf_counter()
    loads = [a for a in ("graft", "plain") if a in inputs.arms]
    # each pair of engine processes runs every round, the pairs loaded in alternate orders (see --pairs)
    pairs = [loads if i % 2 == 0 else loads[::-1] for i in range(_pairs_of(args, loads))]
    rounds = [arm_order(first, args.repeat) for first in pairs]  # each pair's, in the order run
    order = [rnd for pair in rounds for rnd in pair]
    bars = _Bars(progress, out)
    new_turns = _turns_of(args)

    def start(job: dict[str, Any], turn: Any = None) -> ArmProcess:
        label = job["arm"] if job["workloads"] else "plain (scoring only)"
        return ArmProcess(job, workdir, bars.on_events(label), timeout=args.timeout or None, turn=turn)

    def job_for(arm: str, generate: bool, score_own: bool) -> dict[str, Any]:
        graft = arm == "graft"
        twin = plan if graft else inputs.plain_plan
        # --baseline-as-is: the plain arm runs the baseline file with its plugins (not the
        # scorer, which scores every output under the unmodified model)
        plugins = graft or (as_is and generate)
        return {
            "arm": arm,
            "llm_kwargs": llm_kwargs(twin, graft=plugins, **overrides),
            "report_plugins": plugins,
            "env": {**threads[0], **({} if graft else inputs.plain_env)},  # applied before vLLM loads
            "workloads": wl_jobs if generate else [],
            "batch": args.batch,
            "repeat": args.repeat,
            "ignore_eos": args.ignore_eos,
            "log_path": str(workdir / f"{arm}.log"),
            "score_own": score_own,
            "workloads_by_name": by_name,
        }

    def score_for_plain(graft_raw: dict[str, Any]) -> dict[str, Any]:
        if args.no_ppl or as_is:  # an as-is baseline does not score: the scorer does
            return {}
        return _outputs_of("graft", graft_raw, prompt_sets)

    def score_all(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return {k: v for arm, raw in results.items() for k, v in _outputs_of(arm, raw, prompt_sets).items()}

    arms = inputs.arms
    jobs = {arm: job_for(arm, True, arm == "plain" and not args.no_ppl and not as_is) for arm in arms}
    scorer = job_for("plain", False, False) if ("plain" not in arms or as_is) and not args.no_ppl else None
    try:
        with bars:
            results, scores = run_arms(
                jobs,
                rounds[0],
                start=start,
                score_for_plain=score_for_plain,
                scorer_job=scorer,
                score_all=score_all,
                turns=new_turns(),
            )
            for pair in rounds[1:]:  # the same rounds in engines loaded the other way round, unscored
                again = {arm: {**job, "score_own": False} for arm, job in jobs.items()}
                more, _ = run_arms(again, pair, start=start, score_for_plain=lambda _: {}, turns=new_turns())
                results = pool_runs(results, more)
    except ArmFailed as e:
        return _arm_failed(e, err), None
    result = assemble(
        deployment=str(args.deployment),
        plan_info=_plan_info(plan),
        settings=_settings(args, inputs, order),
        prompt_sets=prompt_sets,
        arm_results=results,
        scores=scores,
        decode=inputs.tokenizer.decode,
        wall_s=time.perf_counter() - t_start,
        environment={**_environment(plan), "threads": threads[1], "threads_env": threads[0]},
    )
    if not keep_logs:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return EXIT_OK, result


# ============================================================================== parser
def _add_baseline_and_output_args(p: argparse.ArgumentParser) -> None:
    """bench's baseline (what the plain arm runs), scoring and output arguments."""
    p.add_argument(
        "--baseline",
        metavar="DEPLOYMENT|no-package",
        help="what the plain arm runs (default: the deployment's plain twin, its model and "
        "engine section without plugins). A deployment file: that file's plain twin, "
        "same model (e.g. the deployment turns on vLLM's own ngram speculation in its "
        "engine section, the baseline is plain vLLM). 'no-package': the twin with "
        "vLLM's plugin loader told to skip vllm-graft (VLLM_PLUGINS), to measure what "
        "installing the package costs. Perplexity is scored by the plain arm, so "
        "under the baseline's engine. With --baseline-as-is the file runs with its plugins",
    )
    p.add_argument(
        "--baseline-as-is",
        action="store_true",
        help="run the --baseline deployment file as is, its plugins on, as the plain arm: two "
        "deployments side by side (e.g. a third-party KV compressor against streaming on "
        "the same model); a separate plain engine (the file's twin) scores both arms' "
        "outputs under the unmodified model",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate max-tokens tokens even past <|endoftext|> (fixed output lengths)",
    )
    p.add_argument("--no-ppl", action="store_true", help="skip scoring outputs under the unmodified model")
    p.add_argument("--json", metavar="FILE", help="write the full result as JSON ('-': stdout)")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of the figures")
    p.add_argument("--log-dir", metavar="DIR", help="keep the engines' logs and raw results here")
    p.add_argument(
        "--timeout",
        type=float,
        default=0,
        metavar="S",
        help="give up on an arm S seconds after its process started (it stays alive "
        "while the other arm takes its turns)",
    )
    p.add_argument("--require-identical", action="store_true", help="exit 5 when the arms' greedy outputs differ")


def _add_suite_args(p: argparse.ArgumentParser) -> None:
    """bench --suite and its arguments."""
    p.add_argument(
        "--suite",
        metavar="FILE",
        nargs="?",
        const="DEFAULT",
        help="run every case of a suite file (YAML; default benchmarks/suite.yaml) and write "
        "its results, BENCHMARKS.md's generated section and a plot (--quick, --only)",
    )
    p.add_argument(
        "--quick", action="store_true", help="suite: the suite file's quick settings (fewer prompts, tokens, repeats)"
    )
    p.add_argument(
        "--only",
        action="append",
        metavar="NAME[,NAME]",
        help="suite: run only these cases (repeatable or a comma list)",
    )
    p.add_argument("--list-cases", action="store_true", help="suite: list the cases and exit")
    p.add_argument(
        "--render",
        action="store_true",
        help="suite: run nothing; rewrite the Markdown section and plot from the saved results",
    )
    p.add_argument(
        "--no-write",
        action="store_true",
        help="suite: print the table only; do not write the results, Markdown section and plot the suite file names",
    )


def add_command(sub: Any) -> None:
    from ..workloads import WORKLOADS

    p = sub.add_parser(
        "bench",
        help="A/B benchmark: plain vLLM vs the deployment on the same workloads",
        description="Run the same deterministic workloads through plain vLLM and through the "
        "deployment (each in its own process, in-process engine, greedy decoding) and "
        "report output tokens/s, time to first token, inter-token latency, peak KV "
        "blocks in use, peak memory, whether greedy outputs are identical, and the "
        "perplexity of the outputs under the unmodified model.",
        epilog=f"Workloads: {', '.join(WORKLOADS)} (--list-workloads describes them). Exit codes: "
        "0 ok, 1 invalid deployment (no engine started), 2 bad command line, 3 a plugin "
        "failed to load, 4 an engine run failed, 5 outputs differ (with --require-identical).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("deployment", nargs="?", help="deployment YAML file")
    p.add_argument(
        "--workload",
        action="append",
        metavar="NAME[,NAME]",
        help="workload(s) to run; repeatable or a comma list (default: all)",
    )
    p.add_argument("--list-workloads", action="store_true", help="describe the built-in workloads and exit")
    p.add_argument("--num-prompts", type=int, default=8, metavar="N", help="prompts per workload (default 8)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=64,
        metavar="N",
        help="output tokens per request (default 64; less where the context is full)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=0,
        metavar="N",
        help="requests in flight at once; the next is submitted when one finishes "
        "(default 0: all of a workload's requests at once)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run each workload N times per engine, the two arms taking turns in an "
        "alternating order (graft plain, plain graft, ...; both engines stay loaded); "
        "report the median tokens/s with the min-max range (default 1)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload selection and engine seed (default 0)")
    p.add_argument(
        "--pairs",
        type=int,
        default=2,
        metavar="N",
        help="run the rounds in N pairs of fresh engine processes, loaded in alternate orders (graft "
        "then plain, plain then graft, ...), and pool their runs (default 2). An engine process keeps a "
        "speed bias of a few %% for its life (a SmolLM2 fp32 A/A's two pairs read 1.07 and 1.02 on a "
        "2-core AVX2 VM, each pair's runs within 2-3%%), so more pairs with fewer --repeat rounds each average it out; "
        "1: a single pair, graft loaded first (half the engine loads)",
    )
    p.add_argument(
        "--interleave",
        choices=("run", "step"),
        default=None,
        help="step (the default with two arms): both arms run each round at once and take turns engine "
        "step by engine step, each arm's clock counting only its own turns, so that the machine's drift "
        "over seconds reaches both arms alike (an A/A's per-run ratios: sd 0.028 against 0.081 run by run "
        "on a 2-core VM); both engines' caches are then cold at each step (12%% fewer tok/s there). run: "
        "the arms take turns run by run",
    )
    p.add_argument(
        "--arms",
        default="plain,graft",
        metavar="ARMS",
        help="which arms to run: plain, graft or plain,graft (default both)",
    )
    _add_baseline_and_output_args(p)
    _add_suite_args(p)
    p.set_defaults(func=cmd_bench)
