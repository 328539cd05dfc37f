# Set-up is part of every target: `make serve` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
# Installed first so that the project's torch range does not pull a multi-GB CUDA build.
# A GPU user overrides it, e.g. `make serve TORCH="torch==2.13.0 --index-url ..."`.
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install serve test bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/serve run deploy/serve.yaml

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
