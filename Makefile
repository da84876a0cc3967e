# make demo: train the demo model on 8 simulated CPU devices.   make test: run the test suite.
# Each creates .venv (python3 -m venv) when missing and installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: demo test install install-dev clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(PIP) install -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(PIP) install -e ".[dev,convert,plot]"
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

demo: $(VENV)/.installed
	$(BIN)/python -m jaxseek.train --config configs/demo.yaml

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q -n 2 tests

clean:
	rm -rf $(VENV) runs .pytest_cache
