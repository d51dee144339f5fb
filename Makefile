# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# TORCH_SPEC defaults to the CPU build; with a GPU, e.g. `make test TORCH_SPEC=torch`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo lint bench install

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m gptlab demo

lint: $(STAMP)
	$(PY) -m ruff check src tests
