# Two commands a user needs: `make demo` and `make test`. Both set up .venv themselves.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# The CPU build of torch is the default here; a GPU user installs a CUDA build into the venv first
# (see README, "GPU hosts"), and pip keeps it because it satisfies pyproject's range.
TORCH  ?= torch==2.13.0

.PHONY: venv test demo proto proto-check clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

# compileall: the tests start hundreds of daemons, trainers and CLIs; with PYTHONDONTWRITEBYTECODE
# set (as on CI machines) each would compile peerd from source again.
test: venv
	$(PY) -m compileall -q peerd cli >/dev/null
	$(PY) -m pytest -q -ra --durations=15 tests

demo: venv
	$(VENV)/bin/peerd demo

# Regenerate the committed gRPC/protobuf code from protos/ (tests fail when it is stale).
proto: venv
	$(PY) -m peerd.protogen

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
