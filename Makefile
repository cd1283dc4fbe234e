# `make demo`: set up and run the main job.  `make test`: set up and run the test suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.roundpipe-installed

.PHONY: demo test setup clean

demo: $(STAMP)
	$(BIN)/roundpipe train

test: $(STAMP)
	$(BIN)/python -m pytest -q

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py scripts/setup-venv.sh $(wildcard csrc/*.cpp csrc/*.h)
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup-venv.sh
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info roundpipe/_C*.so
