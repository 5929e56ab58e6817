# The two commands the README names: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup prerequisites prerequisites-demo images demo test test-unit bench kafka-start kafka-stop clean

# uv installs the same versions in about a quarter of pip's time (33 s against 139 s on this 2-core machine);
# pip does it when uv cannot be had or fails
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	( $(BIN)/pip install -q uv && $(BIN)/uv pip install -q --python $(BIN)/python -e '.[test]' ) \
	  || ( $(BIN)/pip install -q --upgrade pip && $(BIN)/pip install -q -e '.[test]' )
	touch $(STAMP)

setup: $(STAMP)

# What the machine needs (installed as root with apt; otherwise one line naming it): deploy/prerequisites.sh
prerequisites:
	deploy/prerequisites.sh test

prerequisites-demo:
	deploy/prerequisites.sh demo

# The container images the tests build on first use (docs/containers.md), built ahead
images: prerequisites setup
	$(BIN)/python deploy/docker/build_images.py all

demo: prerequisites-demo setup
	$(BIN)/sluice demo

test: prerequisites setup
	$(BIN)/python -m pytest

test-unit: setup
	$(BIN)/python -m pytest tests/unit

kafka-start: setup
	$(BIN)/sluice kafka start

kafka-stop: setup
	$(BIN)/sluice kafka stop

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
