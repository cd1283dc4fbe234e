# `make demo`: set up and run the main job.  `make test`: set up and run the test suite.
# The setups differ (scripts/setup-venv.sh): the demo's installs only what `roundpipe train`
# runs; the test setup adds Triton (interpreter-mode kernel tests) and the [dev] extra, pinned by
# requirements/test-constraints.txt (`make lock` re-resolves it on purpose).
# A venv already set up for the tests serves the demo as it is.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_STAMP := $(VENV)/.roundpipe-demo
TEST_STAMP := $(VENV)/.roundpipe-installed
SETUP_INPUTS := pyproject.toml setup.py scripts/setup-venv.sh requirements/test-constraints.txt $(wildcard csrc/*.cpp csrc/*.h)

.PHONY: demo test test-fast lint setup lock versions bench-check clean

demo: $(if $(wildcard $(TEST_STAMP)),$(TEST_STAMP),$(DEMO_STAMP))
	$(BIN)/roundpipe train

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q --durations=30

# A quick subset (about 2 minutes on 2 cores): layering, config, planner, simulator, microbatching
FAST_TESTS := tests/test_layering.py tests/test_import.py tests/test_shapes.py tests/planner tests/sim \
	tests/engine/test_microbatch.py tests/engine/test_config.py tests/engine/test_call_errors.py
test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(FAST_TESTS)

# ruff (pyproject.toml: pyflakes, pycodestyle errors, import order, bugbear, blind except)
lint: $(TEST_STAMP)
	$(BIN)/ruff check .

setup: $(TEST_STAMP)

# The main job's speed guard (about 2 minutes, quiet machine): `roundpipe train --devices cpu` against
# `--engine torch`, 3 alternated pairs, the ratio beside the last committed row (bench/cli.py).
bench-check: $(TEST_STAMP)
	$(BIN)/python bench/cli.py --no-save

# The test environment's exact versions, re-resolved on purpose (then run the suite, commit the file).
lock:
	PYTHON=$(PYTHON) bash scripts/lock.sh

# What the test venv holds, for logs: the versions that decide a test run.
versions: $(TEST_STAMP)
	@$(BIN)/python -m pip --disable-pip-version-check list 2>/dev/null | grep -i -E '^(torch|triton|transformers|peft|accelerate|trl|bitsandbytes|tokenizers|safetensors|numpy|pytest|pytest-timeout|hypothesis|ruff) '

$(DEMO_STAMP): $(SETUP_INPUTS)
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup-venv.sh demo
	touch $@

$(TEST_STAMP): $(SETUP_INPUTS)
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup-venv.sh test
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info roundpipe/_C*.so
