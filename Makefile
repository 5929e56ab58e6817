# The two commands the README names: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-unit bench kafka-start kafka-stop clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/sluice demo

test: setup
	$(BIN)/python -m pytest

test-unit: setup
	$(BIN)/python -m pytest tests/unit

kafka-start: setup
	$(BIN)/sluice kafka start

kafka-stop: setup
	$(BIN)/sluice kafka stop

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
