# Two commands: `make run` starts the whole portal, `make test` runs the suite.
# Both create .venv on first use; nothing needs to be installed by hand.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test test-fast durations lint bench bench-gpu clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: this machine installs the CPU build from a local file.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python manage.py up $(ARGS)

# The project's modules compiled once, before the suite: where PYTHONDONTWRITEBYTECODE is set (as
# on the machines this suite runs on here), no process writes the bytecode it compiles, and each of
# the hundreds of processes the suite starts (agents, workers, `up` and its children) compiled the
# project again: 6 of the 29 CPU-s of an `up` started and stopped on a slow 2-core machine
# (BENCHMARKS.md).
COMPILE := $(BIN)/python -m compileall -q -j 0 gpuportal scheduling inference bench tests manage.py

# Three processes, whole files each (tests/conftest.py orders them), even on two cores: most tests
# wait on the processes they start (an agent's registration, a replica's load, a heartbeat), and a
# third file runs meanwhile; on this 2-core machine that was a fifth less time than two.
test: $(STAMP)
	$(BIN)/ruff check .
	$(COMPILE)
	$(BIN)/pytest -n 3 --dist loadfile --no-loadscope-reorder $(ARGS)

# The suite as `make test` runs it, recording each file's time in tests/durations.json: the order
# in which `make test` hands files out, the longest first (tests/support/durations.py).
durations: $(STAMP)
	$(COMPILE)
	$(BIN)/pytest -n 3 --dist loadfile --no-loadscope-reorder --record-durations $(ARGS)

# The inner loop: the tests that start no process (those not marked `slow`, which
# tests/support/process_watch.py keeps true), in under two minutes. CI runs the whole of `make test`.
test-fast: $(STAMP)
	$(BIN)/pytest -n auto --maxprocesses 2 -m "not slow" $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python -m bench.run_all $(ARGS)

bench-gpu: $(STAMP)
	$(BIN)/python -m bench.gpu $(ARGS)

clean:
	rm -rf $(VENV) var
