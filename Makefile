# dtrun: `make demo` runs the demo job on localhost, `make test` runs the test suite.
# Both set up the virtual environment first (Python, the packages, Open MPI from PyPI).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dtrun-installed
N ?= 3

.PHONY: setup demo test test-unit bench cluster-up cluster-down clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/dtrun --hostfile hostfiles/localhost $(abspath $(BIN))/python examples/hello.py

test: setup
	$(BIN)/python -m pytest

test-unit: setup
	$(BIN)/python -m pytest -m "not cluster and not mpi"

bench: setup
	mkdir -p bench-results
	$(BIN)/python benchmarks/bench_launch.py
	@if [ -f benchmarks/bench_collectives.py ]; then $(BIN)/python benchmarks/bench_collectives.py; fi
	@if [ -f benchmarks/bench_doctor.py ]; then $(BIN)/python benchmarks/bench_doctor.py; fi

cluster-up: setup
	$(BIN)/python -m tests.nscluster up $(N)

cluster-down:
	$(BIN)/python -m tests.nscluster down

clean:
	rm -rf $(VENV) bench-results .pytest_cache
