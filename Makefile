# Gyre developer tasks. `make help` lists them.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
MAKEFLAGS += --no-builtin-rules

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CONSTRAINTS ?= constraints.txt
# Every other dependency, pinned: the images install the same versions (deploy/docker/lock.py, `make lock`)
LOCK ?= deploy/docker/lock.txt
DEMO_CONFIG ?= configs/reverse_text/demo.toml
DEMO_OUT ?= outputs/demo
PYTEST_ARGS ?=
SMOKE_ARGS ?=

.PHONY: help install lock demo test test-fast lint format proto generated bench images smoke smoke-clean clean

help: ## Show this help
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS) $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c $(CONSTRAINTS) -c $(LOCK) -e '.[dev]'
	touch $@

install: $(VENV)/.installed ## Create .venv (if missing) and install gyre with dev extras (torch pinned by constraints.txt, the rest by the lock)

lock: ## Re-resolve deploy/docker/lock.txt from pyproject.toml (newest releases; then `make install` and the tests)
	$(PYTHON) deploy/docker/lock.py

demo: install ## The main job: tiny model, SFT warm-up, then async RL on reverse_text (CPU, < 15 min)
	$(VENV)/bin/gyre rl @ $(DEMO_CONFIG) --output-dir $(DEMO_OUT) --fresh  # a fresh run each time (a re-run without --fresh continues)

test: install ## Run the whole test suite (what CI runs)
	$(VENV)/bin/pytest $(PYTEST_ARGS)

test-fast: install ## Unit tests only
	$(VENV)/bin/pytest tests/unit $(PYTEST_ARGS)

lint: install ## ruff check + format check + unique test file names
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@# tests/ has no __init__.py: two test files of one name stop pytest's whole collection (a targeted run passes)
	@dups=$$(find tests -name 'test_*.py' -printf '%f\n' | sort | uniq -d); \
	  if [ -n "$$dups" ]; then echo "test files with the same name (rename one): $$dups"; exit 1; fi

format: install ## Apply ruff fixes and formatting
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

proto: install ## Regenerate libs/gyre/v1 from proto/gyre/v1/*.proto
	PY=$(PY) bash scripts/gen_proto.sh

generated: install ## Regenerate derived files: chart values schema, dashboards, chart copy of alert rules
	$(PY) charts/gyre/schema/generate.py
	$(PY) deploy/grafana/build_dashboards.py
	cp deploy/prometheus/alerts.yaml charts/gyre/prometheus/rules.yaml

bench: install ## Run every benchmark (prints side-by-side ratios)
	$(VENV)/bin/gyre bench inference
	$(VENV)/bin/gyre bench trainer
	$(VENV)/bin/gyre bench orchestrator
	$(VENV)/bin/gyre bench async

images: ## Build the CPU images gyre-{inference,trainer,orchestrator}:kind with Docker (deploy/docker/build.sh)
	deploy/docker/build.sh

smoke: install images ## Container smoke: the chart's pods (kind values) in Docker as rendered, then the kind smoke's checks
	$(PY) deploy/docker/smoke.py $(SMOKE_ARGS)

smoke-clean: install ## Remove the containers, networks and volumes an interrupted smoke left behind
	$(PY) deploy/docker/smoke.py --clean

clean: ## Remove outputs and caches (keeps .venv)
	rm -rf outputs .pytest_cache .ruff_cache
