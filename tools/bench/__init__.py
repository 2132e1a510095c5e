"""`vllm-graft bench DEPLOYMENT`: the A/B benchmark, plain vLLM vs the deployment.

One command run sends the same deterministic workloads (:mod:`.workloads`) through two
engines, each in its own spawned child process with an in-process vLLM engine:

* ``graft``: ``vllm.LLM(**llm_kwargs(plan, graft=True))``: the deployment's plugins active;
* ``plain``: ``vllm.LLM(**llm_kwargs(plan, graft=False))``: the same model and engine
  arguments, no plugins. It finishes second and also scores both arms' outputs under the
  unmodified model (perplexity).

Both engines are loaded once (one after the other: the graft arm's first, then plain's) and
stay loaded; with ``--repeat N`` the parent then asks each arm in turn to run every workload
once, alternating the order per run (graft plain, plain graft, graft plain, ...:
:func:`.stats.arm_order`), so that neither arm always runs first. With ``--pairs N`` (default 2)
it then does all of that again in N-1 more pairs of processes, loaded in alternate orders (plain
first, graft first, ...), and pools the pairs' runs (:func:`.command.pool_runs`), each pair's own
median kept beside (``by_pair``): on the 2-core machine the engine
loaded second ran 3-15% faster whichever arm it was (an A/A at the suite's quick settings read
0.948-1.002 over four invocations with graft loaded first, 1.032 twice with plain first; with
128-token outputs one pair alone read 0.87-0.98 graft first and 1.05-1.11 plain first, with
vLLM's thread binding on or off). Pooled, the A/A read 0.949-1.030 over six invocations: the
bias cancels on average, but its size changes from one pair of processes to the next. Each figure is the median of
the N runs (tokens/s) or comes from the run with the median wall time (the others), with the
min-max range; the ratio is the median of the per-run ratios graft / plain (run r of each arm,
seconds apart), its range theirs (:func:`.stats.ratio_of`). One engine alone drifts by +-10% over
tens of seconds on the 2-core VM (30 identical runs in one process: 71-98 tok/s, in phases; its
CPU time per run tracks the wall time, so the CPU itself ran slower, not the engine waiting),
and a pair of runs seconds apart shares its phase where two medians need not: nine A/A
invocations (one pair, 3-8 rounds) read 0.979-1.023 as the paired median and
0.958-1.093 as the ratio of the arms' medians (kept as ``of_medians``). Writing the machine's free
memory before loading does not help here: the VM's balloon reports freed pages to the host
(virtio-balloon free page reporting), so memory freed is faulted in afresh by the next process.
``vllm-graft bench --suite`` (:mod:`.suite`) runs a list of such cases and writes
BENCHMARKS.md's generated section.

How each figure is measured (also written into the JSON output, ``measurement``):

* output tokens/s: output tokens of all requests of a workload / wall time from the first
  request submitted to the last token received (the engine loop below; warm-up excluded).
* TTFT and inter-token latency: the child drives the engine itself (``LLMEngine.add_request``
  with cumulative outputs, then ``LLMEngine.step()`` until done) and stamps every output
  token with ``time.perf_counter()`` when the step that produced it returns. TTFT = first
  token - submission of that request; ITL = the gaps between a request's tokens (a step that
  delivers k tokens at once, as speculative decoding does, counts as k gaps of 1/k of it);
  TPOT (per request) = (last - first token) / (tokens - 1). vLLM's own per-request
  ``RequestOutput.metrics`` (``RequestStateStats``, ``disable_log_stats=False``) are kept
  beside them in the JSON as a cross-check (``vllm_ttft_s``, ``vllm_tpot_s``).
* KV blocks in use: blocks allocated from the scheduler's KV block pool
  (``scheduler.kv_cache_manager.block_pool``: total - free - the null block), sampled after
  every ``Scheduler.schedule()`` call (the allocation point) via a patch through
  :data:`~vllm_graft.integration.patches.PATCHES` (owner ``bench``, undone afterwards);
  the peak per workload is reported. Prefix-cached blocks no request holds count as free.
* peak memory: ``ru_maxrss`` of the arm's child process after its last timed workload
  (model, KV cache and generation; the plain arm's scoring pass comes after and is not in it).
* identical outputs: greedy (temperature 0) output token ids, per prompt, graft vs plain;
  the first differing output-token position when they differ.
* perplexity: exp(mean negative log-likelihood of the output tokens) under the unmodified
  model: prompt + output scored by the plain engine with ``prompt_logprobs=0``.

The package: :mod:`.stats` (pure helpers: metrics, output comparison, result assembly),
:mod:`.report` (table, report, plot), :mod:`.arm` (the arm's child process, the one part that
drives vLLM) and :mod:`.command` (the parent side and the command line).
"""

from __future__ import annotations

from .command import (
    EXIT_DIFFERENT,
    EXIT_INVALID,
    EXIT_OK,
    EXIT_RUN_FAILED,
    EXIT_USAGE,
    ArmFailed,
    ArmProcess,
    add_command,
    cmd_bench,
    run_arms,
    run_bench,
)
from .report import COLUMNS, render_report, render_table, write_plot
from .stats import (
    ARMS,
    BUSY_OTHER_CPUS,
    MEASUREMENT,
    SCHEMA,
    arm_order,
    assemble,
    by_pair,
    compare_outputs,
    first_difference,
    mean,
    median,
    median_run,
    nll_of,
    paired_ratios,
    percentile,
    ratio_of,
    relative_change,
    request_timing,
    spread,
    summarize,
    token_gaps,
)

__all__ = [
    "ARMS",
    "BUSY_OTHER_CPUS",
    "COLUMNS",
    "EXIT_DIFFERENT",
    "EXIT_INVALID",
    "EXIT_OK",
    "EXIT_RUN_FAILED",
    "EXIT_USAGE",
    "MEASUREMENT",
    "SCHEMA",
    "ArmFailed",
    "ArmProcess",
    "add_command",
    "arm_order",
    "assemble",
    "by_pair",
    "cmd_bench",
    "compare_outputs",
    "first_difference",
    "mean",
    "median",
    "median_run",
    "nll_of",
    "paired_ratios",
    "percentile",
    "ratio_of",
    "relative_change",
    "render_report",
    "render_table",
    "request_timing",
    "run_arms",
    "run_bench",
    "spread",
    "summarize",
    "token_gaps",
    "write_plot",
]
