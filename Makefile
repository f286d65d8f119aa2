# qosfs: everything a fresh machine needs is installed by these targets.
#   make demo   install, mount a demo tree with the default policy, run a short workload
#   make test   install, check (make lint: ruff, mypy --strict), run the test suite
#               (what .ci/run runs)
#   make bench  install, run every benchmark suite, write bench/results/REPORT.md
#               (the training suite alone took 19 min here; make bench-quick: shorter, noisier)
#   make passthrough-hp   libfuse's C++ example passthrough_hp, the bench's peer (from the
#                         same source as the libfuse that make deps builds)
#   make install          qosfs in its own virtualenv (with kernel passthrough, as make deps
#                         builds it), /usr/local/bin/qosfs, the systemd unit, the samples,
#                         shell completions and the man page (PREFIX, DESTDIR respected)

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
# systemd: systemd-analyze and systemd-escape, which the tests run on the unit.
# e2fsprogs: mkfs.ext4, for the tests' small ext4 with blocks reserved for root.
# redis-server: the coordinator of cluster-scoped caps, started by the tests on a temp socket
# (redis-tools comes with it: redis-cli, redis-benchmark for bench cluster); openssl: the
# TLS test's certificate; prometheus: promtool (check metrics/rules, test rules) and the
# server the dashboard test scrapes a live mount with; tmux: the terminal `qosfs top` is
# tested in.
# build-essential, dpkg-dev: kernel passthrough needs libfuse >= 3.17, which deploy/libfuse/
# builds from Debian's source package where the system's is older (dpkg-source unpacks it,
# cc compiles it and pyfuse3; g++ the bench's passthrough_hp).
# xfsprogs: mkfs.xfs, for the tests that count passed-through reads on XFS as on ext4.
SYSTEM_PACKAGES := fuse3 libfuse3-dev pkg-config fio systemd e2fsprogs redis-server openssl \
	prometheus tmux build-essential dpkg-dev xfsprogs

# make install: where things go. DESTDIR stages them (packaging, tests) without touching
# the real system; the installed files refer to PREFIX paths only.
PREFIX  ?= /usr/local
DESTDIR ?=
BINDIR  := $(PREFIX)/bin
LIBDIR  := $(PREFIX)/lib/qosfs
UNITDIR := $(PREFIX)/lib/systemd/system
DOCDIR  := $(PREFIX)/share/doc/qosfs
BASHCOMPDIR := $(PREFIX)/share/bash-completion/completions
ZSHCOMPDIR  := $(PREFIX)/share/zsh/site-functions
MAN1DIR     := $(PREFIX)/share/man/man1
CONFDIR := /etc/qosfs

.PHONY: deps system-deps venv kernel-passthrough passthrough-hp demo test lint bench-deps \
	bench bench-quick clean install install-python install-passthrough install-files \
	install-cli-docs uninstall

deps: system-deps venv kernel-passthrough

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
	@$(PY) -m pip install -q -e '.[test,libs]' || \
		echo "torch/safetensors not installed: the real-library tests will be skipped"
	@touch $(PY)

venv: $(PY)

# libfuse >= 3.17 and pyfuse3 patched for kernel passthrough, into the venv (its prefix is
# $(VENV)/opt/libfuse; sources and build tree in $(LIBFUSE_BUILD)); see deploy/libfuse/
# build.sh. Does nothing when already built (its stamp). If it cannot be built (e.g. no
# Debian source reachable) it says so in one line and qosfs runs without passthrough.
LIBFUSE_BUILD ?= build/libfuse
kernel-passthrough: venv
	@deploy/libfuse/build.sh $(VENV) $(LIBFUSE_BUILD) || true

passthrough-hp: deps
	deploy/libfuse/build.sh $(VENV) $(LIBFUSE_BUILD) passthrough_hp

demo: deps
	$(PY) -m bench demo

# The tests run after the static checks: a lint failure is cheaper to learn first. The
# sources are byte-compiled first: the tests start a thousand daemons and CLI processes
# from this tree, which an editable install leaves uncompiled, and where Python may not
# write .pyc files itself (PYTHONDONTWRITEBYTECODE, as on the CI machines) each of them
# compiled qosfs again: ~0.2 s a start. The suite is asked to stay near 15 minutes: each
# run ends with its 25 slowest tests (--durations), so a run that grows says where.
test: lint
	$(PY) -m compileall -q qosfs bench tests >/dev/null
	$(PY) -m pytest -q --durations=25

# ruff (rule set in pyproject.toml) over everything; mypy --strict over the package.
lint: deps
	$(PY) -m ruff check qosfs tests bench
	$(PY) -m mypy

# matplotlib draws the report's plots; if it cannot be installed the report says so.
# The training suite's DLIO: its requirements from the training extra, then the package
# itself without its unresolvable ones (pyproject.toml says why); without them that suite
# is skipped and says so.
DLIO := dlio-benchmark==2.0.0
bench-deps: deps
	@$(PY) -m pip install -q -e '.[bench]' || echo "matplotlib not installed: REPORT.md will have no plots"
	@($(PY) -m pip install -q -e '.[bench,training]' && $(PY) -m pip install -q --no-deps '$(DLIO)') || \
		echo "DLIO not installed: bench training will be skipped"

bench: bench-deps
	$(PY) -m bench all

bench-quick: bench-deps
	$(PY) -m bench all --quick

# qosfs and its dependencies in a virtualenv of their own (pyfuse3 is built against
# libfuse3, hence system-deps). The launcher runs its python by path, which stays valid
# when DESTDIR is moved into place; -P keeps the caller's directory off sys.path.
# The prerequisites run in this order (install-passthrough replaces install-python's
# pyfuse3, install-cli-docs runs its python).
install: system-deps install-python install-passthrough install-files install-cli-docs
	@if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then systemctl daemon-reload; fi

install-python:
	$(PYTHON) -m venv --clear $(DESTDIR)$(LIBDIR)
	$(DESTDIR)$(LIBDIR)/bin/python -m pip install -q '.[cli-docs]'

# Kernel passthrough in the installed virtualenv, as make deps gives $(VENV): libfuse under
# $(LIBDIR)/opt/libfuse and pyfuse3 patched and linked to it by rpath, both naming PREFIX
# paths only, staged under DESTDIR (deploy/libfuse/build.sh, target "installed"; its build
# tree is $(LIBFUSE_BUILD)/bld-installed, the sources are shared with make deps). If it
# cannot be built it says why in one line and the install goes on with PyPI's pyfuse3,
# without passthrough.
install-passthrough:
	@DESTDIR='$(DESTDIR)' deploy/libfuse/build.sh $(LIBDIR) $(LIBFUSE_BUILD) installed || true

# Everything but the Python package: no network, no compiler.
install-files:
	install -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(UNITDIR) $(DESTDIR)$(DOCDIR)/examples \
		$(DESTDIR)$(CONFDIR)
	printf '#!/bin/sh\n# written by make install: qosfs from its virtualenv\n' \
		> $(DESTDIR)$(BINDIR)/qosfs
	printf 'exec %s -P -m qosfs "$$@"\n' '$(LIBDIR)/bin/python' >> $(DESTDIR)$(BINDIR)/qosfs
	chmod 0755 $(DESTDIR)$(BINDIR)/qosfs
	sed 's|/usr/local/|$(PREFIX)/|g' systemd/qosfs@.service > $(DESTDIR)$(UNITDIR)/qosfs@.service
	chmod 0644 $(DESTDIR)$(UNITDIR)/qosfs@.service
	install -m 0644 README.md $(DESTDIR)$(DOCDIR)/README.md
	install -d $(DESTDIR)$(DOCDIR)/docs
	install -m 0644 docs/*.md $(DESTDIR)$(DOCDIR)/docs/
	install -m 0644 systemd/mnt-mlfs.toml systemd/mnt-mlfs.env $(DESTDIR)$(DOCDIR)/examples/

# Completions for bash and zsh and the man page, generated from the argument parser
# (qosfs.daemon.cli.build_parser) by shtab and argparse-manpage, so they cannot drift from
# the options. The tools come with the cli-docs extra; the daemon never imports them.
CLIDOCS_PY  ?= $(DESTDIR)$(LIBDIR)/bin/python
PARSER      := qosfs.daemon.cli.build_parser
DESCRIPTION := from qosfs.daemon.cli import build_parser; print(build_parser().description)
install-cli-docs:
	install -d $(DESTDIR)$(BASHCOMPDIR) $(DESTDIR)$(ZSHCOMPDIR) $(DESTDIR)$(MAN1DIR)
	$(CLIDOCS_PY) -m shtab --error-unimportable --shell=bash $(PARSER) \
		-o $(DESTDIR)$(BASHCOMPDIR)/qosfs
	$(CLIDOCS_PY) -m shtab --error-unimportable --shell=zsh $(PARSER) \
		-o $(DESTDIR)$(ZSHCOMPDIR)/_qosfs
	$(CLIDOCS_PY) -c 'import sys; from argparse_manpage.cli import main; sys.exit(main())' \
		--module qosfs.daemon.cli --function build_parser --prog qosfs \
		--project-name qosfs --manual-title 'qosfs manual' \
		--version "$$($(CLIDOCS_PY) -c 'import qosfs; print(qosfs.__version__)')" \
		--description "$$($(CLIDOCS_PY) -c '$(DESCRIPTION)')" \
		--output $(DESTDIR)$(MAN1DIR)/qosfs.1
	chmod 0644 $(DESTDIR)$(BASHCOMPDIR)/qosfs $(DESTDIR)$(ZSHCOMPDIR)/_qosfs \
		$(DESTDIR)$(MAN1DIR)/qosfs.1

# Leaves /etc/qosfs (the administrator's policies) alone.
uninstall:
	rm -f $(DESTDIR)$(BINDIR)/qosfs $(DESTDIR)$(UNITDIR)/qosfs@.service
	rm -f $(DESTDIR)$(BASHCOMPDIR)/qosfs $(DESTDIR)$(ZSHCOMPDIR)/_qosfs $(DESTDIR)$(MAN1DIR)/qosfs.1
	rm -rf $(DESTDIR)$(LIBDIR) $(DESTDIR)$(DOCDIR)

# The venv holds the libfuse that make deps built (and pyfuse3 linked to it), build/ its
# sources: both go, and the next make deps builds them again.
clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
