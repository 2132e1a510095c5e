"""The exit statuses of the ``vllm-graft`` commands (stable, for scripts). A leaf module: it
imports nothing, so every command, whatever its floor, takes its statuses from here.

* 0 :data:`EXIT_OK`: success (for ``check``: the deployment is valid);
* 1 :data:`EXIT_INVALID`: the input is invalid (a deployment, a file, a plugin's parameters:
  every problem is printed), or what the command looks for is missing (``doctor``, ``models``);
* 2 :data:`EXIT_USAGE`: bad command line (unknown command, missing or conflicting arguments);
* 3 :data:`EXIT_PLUGIN`: a plugin failed to load (import error, invalid registration), or what
  the command needs is missing: vLLM (or a supported version of it), torch, matplotlib; the
  message says what to install;
* 4 :data:`EXIT_FAILED`: a run or a check failed (``soak``, ``servebench``, ``bench``: the table
  and the lines above it say which);
* 5 :data:`EXIT_DIFFERENT`: ``bench --require-identical``: a lossless arm's greedy text differed.
"""

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_USAGE = 2
EXIT_PLUGIN = 3
EXIT_FAILED = 4
EXIT_DIFFERENT = 5
