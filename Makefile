# qosfs: everything a fresh machine needs is installed by these targets.
#   make demo   install, mount a demo tree with the default policy, run a short workload
#   make test   install, run the test suite (what .ci/run runs)
#   make bench  install, run every benchmark suite, write bench/results/REPORT.md (~20 min;
#               make bench-quick: ~8 min, noisier)

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
SYSTEM_PACKAGES := fuse3 libfuse3-dev pkg-config fio

.PHONY: deps system-deps venv demo test bench-deps bench bench-quick check clean

deps: system-deps venv

# System packages come from the distribution; apt-get runs only if one is missing.
system-deps:
	@if ! dpkg -s $(SYSTEM_PACKAGES) >/dev/null 2>&1; then \
		echo "installing $(SYSTEM_PACKAGES)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSTEM_PACKAGES) >/dev/null; \
	fi
	@test -e /dev/fuse || modprobe fuse || true

$(PY): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	@touch $(PY)

venv: $(PY)

demo: deps
	$(PY) -m bench demo

test: deps
	$(PY) -m pytest -q

# matplotlib draws the report's plots; if it cannot be installed the report says so.
bench-deps: deps
	@$(PY) -m pip install -q -e '.[bench]' || echo "matplotlib not installed: REPORT.md will have no plots"

bench: bench-deps
	$(PY) -m bench all

bench-quick: bench-deps
	$(PY) -m bench all --quick

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
