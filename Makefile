# Developer entry points. `make demo` and `make test` are the two commands in the README.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-long lint typecheck crds-check unit integration down clean-venv

# The project and its development tooling (devtools/: the `pd-dev` command, the test bed), a
# distribution of its own so that no image ships it; one pip call resolves both together.
# setuptools announces every editable install of a multi-root layout ("Editable
# installation ... folders in your working directory"): an information-only note, filtered by
# its text so that a newcomer's first command shows the project's own output and any real
# build warning still prints.
$(STAMP): pyproject.toml devtools/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	PYTHONWARNINGS="ignore:Editable installation" \
	  $(BIN)/pip install --quiet -e '.[transfer,dev]' -e ./devtools
	touch $(STAMP)

# Builds (once, cached outside the repository) and starts a local control plane, runs the
# operator against it and applies the example PDDeployments.
demo: $(STAMP)
	$(BIN)/pd-dev demo

down: $(STAMP)
	$(BIN)/pd-dev cluster down

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

crds-check: $(STAMP)
	$(BIN)/pd-operator crds --check crds
	$(BIN)/pd-operator crds --check charts/pd-operator/crds

# Everything CI runs: static checks, generated files in sync, the whole pytest suite against
# a real kube-apiserver + etcd + controller-manager and real NIXL agents.
# pytest's exit code 5 (no tests collected) counts as a failure.
test: $(STAMP) lint typecheck crds-check
	$(BIN)/pd-dev cluster build
	PD_OPERATOR_REQUIRE_VLLM=1 $(BIN)/pytest --tb=short --durations=30; rc=$$?; if [ $$rc -eq 5 ]; then echo "error: no tests collected" >&2; exit 1; fi; exit $$rc

unit: $(STAMP)
	$(BIN)/pytest tests/unit

# Scenarios too long for CI on 2 cores (marker `long`; docs/testbed.md lists them).
test-long: $(STAMP)
	$(BIN)/pd-dev cluster build
	PD_OPERATOR_REQUIRE_VLLM=1 $(BIN)/pytest --tb=short -m long tests

integration: $(STAMP)
	PD_OPERATOR_REQUIRE_VLLM=1 $(BIN)/pytest tests/integration tests/e2e

clean-venv:
	rm -rf $(VENV)
