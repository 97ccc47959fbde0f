# ninfer_numba: every target is one line with a comment above it.
# PYTHON=python3 OFFLINE=1 uses that interpreter as it is (no venv) and installs only what it lacks from
# $(WHEELHOUSE), without the network: the path for GPU servers with no internet.
PYTHON ?=
OFFLINE ?=
WHEELHOUSE ?= wheelhouse
WHEEL_PYTHON ?= 3.12
WHEEL_PLATFORM ?= x86_64
MODEL_DIR ?= models
BENCH_MODELS ?=
BENCH_ARGS ?=
VENV := .venv

ifeq ($(PYTHON),)
PY := $(VENV)/bin/python
SETUP := $(VENV)/.installed
else
PY := $(PYTHON)
SETUP := .setup-$(notdir $(PYTHON)).stamp
endif

.PHONY: setup bench test test-gpu test-cudasim wheelhouse serve plot clean

# Create ./.venv (or use PYTHON) and install the package with its dev and bench extras (and, in the venv, the notebook extra).
setup: $(SETUP)

$(VENV)/.installed: pyproject.toml
	@echo "setup: creating $(VENV) and installing ninfer_numba with its dev, bench and notebook extras (a minute or two)"
	python3 -m venv $(VENV) && $(VENV)/bin/python -m pip install -q --upgrade pip && $(VENV)/bin/python -m pip install -q -e ".[dev,bench,notebook]" && touch $@

.setup-$(notdir $(PYTHON)).stamp: pyproject.toml
	@echo "setup: installing ninfer_numba into $(PY) $(if $(OFFLINE),from $(WHEELHOUSE) )(a minute or so)"
	$(PY) -m pip install -q --no-build-isolation $(if $(OFFLINE),--no-index --find-links $(WHEELHOUSE)) -e ".[dev,bench]" && touch $@

# The main job: make the benchmark model(s) and run ours against llama.cpp (9b on a GPU; the CPU reference on a tiny model without one).
bench: $(SETUP)
	$(PY) -m ninfer_numba bench $(if $(BENCH_MODELS),--models $(BENCH_MODELS)) --model-dir $(MODEL_DIR) $(BENCH_ARGS)

# The CPU suite (CI): formats, tokenizer, reference model, server, CLI, harness, the notebooks; then kernels under the CUDA simulator
# (two processes: the simulator runs one Python thread per CUDA thread, so it is CPU-bound).
test: $(SETUP)
	$(PY) -m pytest -q -m "not gpu and not cudasim" tests && NUMBA_ENABLE_CUDASIM=1 $(PY) -m pytest -q -n 2 -p no:benchmark -m cudasim tests

# Only the kernel tests, under the CUDA simulator.
test-cudasim: $(SETUP)
	NUMBA_ENABLE_CUDASIM=1 $(PY) -m pytest -q -n 2 -p no:benchmark -m cudasim tests

# Full-size kernel and model tests on a CUDA GPU.
test-gpu: $(SETUP)
	$(PY) -m pytest -q -m gpu tests

# Wheels of every dependency for Python $(WHEEL_PYTHON) on $(WHEEL_PLATFORM), for machines without internet.
wheelhouse: $(SETUP)
	$(PY) -m tools.wheelhouse --python $(WHEEL_PYTHON) --arch $(WHEEL_PLATFORM) --out $(WHEELHOUSE)

# Serve a model over the OpenAI-compatible API: make serve MODEL=path.gguf
serve: $(SETUP)
	$(PY) -m ninfer_numba serve --model $(MODEL)

# Regenerate plots and tables from the records under results/.
plot: $(SETUP)
	$(PY) -m benchmarks.plot results

# Remove the venv and setup stamps (models and results stay).
clean:
	rm -rf $(VENV) .setup-*.stamp
