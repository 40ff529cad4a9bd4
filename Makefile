# Two commands a user needs: `make demo` and `make test`. Both set up .venv themselves.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# torch 2.13.0 by default: on our CI and dev machines pip takes its CPU build from local disk. From
# PyPI, Linux x86_64 torch is a CUDA build (several GB): a CPU-only host elsewhere takes it from
# PyTorch's CPU index, `make venv TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu`. A GPU user
# installs a CUDA build into the venv first (docs/getting-started.md, "GPU hosts"), and pip keeps it
# because it satisfies pyproject's range.
TORCH  ?= torch==2.13.0
TORCH_INDEX_URL ?=

.PHONY: venv test test-fast test-tools test-docker test-gpu demo proto proto-check clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(if $(TORCH_INDEX_URL),--index-url "$(TORCH_INDEX_URL)") "$(TORCH)"
	$(PIP) install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

# System tools the tests use beyond the venv: dig (tests/test_discovery_lab.py asks the daemons'
# mDNS with it; Debian/Ubuntu package dnsutils) and nft (the lab's NAT router, tests/test_nat_lab.py;
# package nftables), installed with apt as root or through passwordless sudo. The lab tests need
# root anyway; elsewhere this only says what is missing.
TOOLS := dig:dnsutils nft:nftables
test-tools:
	@missing=""; for t in $(TOOLS); do command -v $${t%%:*} >/dev/null 2>&1 || missing="$$missing $${t#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=none; fi; \
	  if [ "$$SUDO" != none ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing$$missing with apt-get"; \
	    { $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive NEEDRESTART_SUSPEND=1 \
	      apt-get install -y -qq $$missing >/dev/null; } || echo "make test: installing$$missing failed" >&2; \
	  else echo "make test:$$missing missing and cannot be installed here (needs apt-get and root): lab tests that need them fail or skip" >&2; fi; fi

# compileall: the tests start hundreds of daemons, trainers and CLIs; with PYTHONDONTWRITEBYTECODE
# set (as on CI machines) each would compile peerd from source again.
test: venv test-tools
	$(PY) -m compileall -q peerd cli >/dev/null
	$(PY) -m pytest -q -ra --durations=15 --ignore=tests/gpu tests

# The inner loop: every test not marked `lab` (namespaces, root) or `slow` (daemons, real runs).
test-fast: venv
	$(PY) -m pytest -q -ra --durations=5 --ignore=tests/gpu -m "not lab and not slow" tests

# The Docker tests alone (`make test` runs them too). As root they start a private dockerd and
# build the image; the base image and wheels are cached in /var/cache/peerd-test (docs/docker.md).
test-docker: venv
	$(PY) -m pytest -q -ra --durations=10 tests/test_docker.py tests/test_docker_docs.py tests/test_docker_engine.py

# On a GPU host with a CUDA build of torch (docs/real-size.md): the checks `make test` cannot run.
test-gpu: venv
	$(PY) -m pytest -q -ra tests/gpu

demo: venv
	$(VENV)/bin/peerd demo

# Regenerate the committed gRPC/protobuf code from protos/ (tests fail when it is stale).
proto: venv
	$(PY) -m peerd.protogen

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
