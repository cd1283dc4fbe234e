# `make demo`: set up and run the main job.  `make test`: set up and run the test suite.
# The setups differ (scripts/setup-venv.sh): the demo's installs only what `roundpipe train`
# runs; the test setup adds Triton (interpreter-mode kernel tests) and the [dev] extra.
# A venv already set up for the tests serves the demo as it is.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_STAMP := $(VENV)/.roundpipe-demo
TEST_STAMP := $(VENV)/.roundpipe-installed
SETUP_INPUTS := pyproject.toml setup.py scripts/setup-venv.sh $(wildcard csrc/*.cpp csrc/*.h)

.PHONY: demo test setup clean

demo: $(if $(wildcard $(TEST_STAMP)),$(TEST_STAMP),$(DEMO_STAMP))
	$(BIN)/roundpipe train

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q

setup: $(TEST_STAMP)

$(DEMO_STAMP): $(SETUP_INPUTS)
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup-venv.sh demo
	touch $@

$(TEST_STAMP): $(SETUP_INPUTS)
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup-venv.sh test
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info roundpipe/_C*.so
