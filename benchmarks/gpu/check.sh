#!/usr/bin/env bash
# The one GPU check (benchmarks/gpu/README.md): environment, dependencies from the carried
# wheels, the kernel tests and the fake-device suite on CUDA, then run.py; a markdown report to
# OUT, every stage a row, within GPU_CHECK_BUDGET seconds (420).
#   bash benchmarks/gpu/check.sh OUT            # on the GPU machine (python3 there has torch)
#   bash benchmarks/gpu/check.sh --smoke OUT    # CPU rehearsal (CI: tests/unit/test_gpu_check.py)
# PYTHON picks the interpreter (default python3).
set -u
cd "$(dirname "$0")/../.." || exit 2
exec "${PYTHON:-python3}" benchmarks/gpu/check.py "$@"
