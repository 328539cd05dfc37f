# Set-up is part of every target: `make serve` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
# Installed first, pinned, so that pip does not resolve the project's torch range to the newest
# wheel; a user picks the build with it, e.g. `make serve TORCH="torch==2.13.0 --index-url ..."`
# (PyTorch's CPU or CUDA index).
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Two pytest-xdist workers: the tests that start servers one after another on one, the others on
# the second meanwhile (tests/conftest.py groups them). PYTEST_WORKERS=0 runs everything in one
# process, in order.
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadscope

.PHONY: install serve test docs clean FORCE

# The torch that was asked for, kept in a file that changes only when TORCH does: a new
# `make serve TORCH=...` reinstalls instead of keeping the torch of the last install.
$(VENV)/.torch: FORCE
	@mkdir -p $(VENV)
	@echo '$(TORCH)' | cmp -s - $@ || echo '$(TORCH)' > $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# A changed TORCH replaces the torch installed before: pip would keep a CPU build that
	# satisfies the same version (2.13.0+cpu is a 2.13.0).
	if [ -f $(VENV)/.torch-installed ] && ! cmp -s $(VENV)/.torch $(VENV)/.torch-installed; then \
		$(PY) -m pip uninstall -y -q torch; fi
	$(PY) -m pip install -q $(TORCH)
	cp $(VENV)/.torch $(VENV)/.torch-installed
	$(PY) -m pip install -q -e '.[dev]'
	# Build the fused paged-attention and quantized-matmul kernels now rather than on first use (about a
	# minute each; without a compiler the engine logs a warning and uses the gather path).
	$(PY) -c "import model.layers.paged_attention as p; p.kernel_available()"
	$(PY) -c "import model.layers.linear.kernel as k; k.kernel_available()"
	$(PY) -c "import model.layers.linear.dense as d; d.kernel_available()"
	touch $@

install: $(VENV)/.installed

# `--address local` starts a fresh Ray instance rather than attaching to one already running;
# service.launch sets Ray Serve's serving-path settings (HAProxy in front of the engine replica's
# own port) unless the environment already has them: RAY_SERVE_ENABLE_HA_PROXY=0 make serve
# falls back to Serve's Python proxy.
serve: install
	@echo "qkv-serve on http://127.0.0.1:8000 (Ctrl-C stops it). Try:"
	@echo "  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d '{\"prompt\": \"The cat\", \"max_tokens\": 16}'"
	$(PY) -m service.launch serve run --address local deploy/serve.yaml

test: install
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

# The hunt for flaky tests, for anyone to repeat (about five times `make test`): the whole suite
# three times back to back; once in a random order (modules shuffled, and the tests within each;
# the seed is printed, STRESS_SEED=<seed> repeats an order); then the end-to-end tests beside a
# busy-loop process that keeps one core busy, as on a shared CI machine. The first failing run
# stops the target; nothing is rerun (a flaky test is fixed at its cause, never retried).
.PHONY: test-stress
test-stress: install
	for run in 1 2 3; do echo "== test-stress: the suite, run $$run of 3"; \
		$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS) || exit 1; done
	seed="$(STRESS_SEED)"; [ -n "$$seed" ] || seed=$$(od -An -N4 -tu4 /dev/urandom | tr -d ' '); \
		echo "== test-stress: the suite in a random order, seed $$seed (STRESS_SEED=$$seed repeats it)"; \
		$(PY) -m pytest -q $(XDIST) --random-order-bucket=module --random-order-seed=$$seed $(PYTEST_ARGS)
	echo "== test-stress: tests/e2e and the README's make serve beside a CPU hog"; \
		$(PY) -c 'while True: pass' & hog=$$!; trap 'kill $$hog 2>/dev/null' EXIT INT TERM; \
		$(PY) -m pytest -q tests/e2e tests/docs/test_readme.py $(PYTEST_ARGS)

# The docs site (mkdocs.yml, docs/) into site/; --strict: a broken link or an unknown generated
# marker fails the build, as it does in CI.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache
