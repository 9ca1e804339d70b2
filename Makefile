# dtrun: `make demo` runs the demo job on localhost, `make test` runs the test suite.
# Both set up the virtual environment first (Python, the packages, Open MPI from PyPI).
# `make test` also installs the system packages the multi-host tests need (.ci/packages)
# when run as root; otherwise it prints the command that would, and those tests skip.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dtrun-installed
RUNTIME_STAMP := $(VENV)/.dtrun-runtime
WHEELHOUSE := $(VENV)/wheelhouse
N ?= 3

# PyTorch CPU tensors are a supported array type: tested where the machine carries the CPU
# wheel on disk (never a multi-GB CUDA build pulled from the registry).
TORCH_WHEELS ?= /opt/wheels

.PHONY: setup system-packages demo test test-unit test-scale bench bench-scale cluster-up cluster-down docs clean

# The runtime: dtrun and its own dependencies only (what `make demo` needs).
$(RUNTIME_STAMP): pyproject.toml setup.py collectives/_fastshm.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e .
	touch $(RUNTIME_STAMP)

# The tests' extras on top of the same .venv: pytest, py-spy, TensorFlow, PyTorch (CPU wheel),
# build and pipx; and a wheelhouse for the packaging tests, which install dtrun into fresh
# environments with no network at test time: dtrun's dependencies, and PyPI's own `checks`,
# `collectives` and `launcher` distributions, which dtrun must install beside untouched.
$(STAMP): $(RUNTIME_STAMP)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	@# tf_keras (Keras 2, TF_USE_LEGACY_KERAS=1) for the Horovod adapter's tests, matched to the
	@# TensorFlow installed; --no-deps: its requirement is `tensorflow`, which tensorflow-cpu provides.
	tf=$$($(BIN)/python -c 'import importlib.metadata as m; v = m.version("tensorflow-cpu").split("."); print(f"{v[0]}.{v[1]}.0")'); \
	$(BIN)/pip install -q --disable-pip-version-check --no-deps "tf_keras~=$$tf"
	@tag=$$($(BIN)/python -c 'import sys; print("cp%d%d" % sys.version_info[:2])'); \
	whl=$$(ls $(TORCH_WHEELS)/torch-*+cpu-$$tag-*.whl 2>/dev/null | head -1); \
	if [ -n "$$whl" ]; then echo "installing $$whl"; $(BIN)/pip install -q "$$whl"; \
	else echo "no PyTorch CPU wheel for $$tag in $(TORCH_WHEELS): the torch tensor tests will skip with that reason"; fi
	$(BIN)/python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
		> $(VENV)/runtime-requirements.txt
	rm -rf $(WHEELHOUSE) && $(BIN)/pip download -q --disable-pip-version-check -d $(WHEELHOUSE) \
		-r $(VENV)/runtime-requirements.txt "setuptools>=64" wheel pip
	$(BIN)/pip wheel -q --disable-pip-version-check --no-deps -w $(WHEELHOUSE)/neighbours checks collectives launcher
	touch $(STAMP)

setup: $(STAMP)

system-packages:
	@bash .ci/system-packages

demo: $(RUNTIME_STAMP)
	$(BIN)/dtrun --hostfile hostfiles/localhost $(abspath $(BIN))/python examples/hello.py

test: system-packages setup
	$(BIN)/python -m pytest

test-unit: setup
	$(BIN)/python -m pytest -m "not cluster and not mpi"

# The scale tier on 65 namespace hosts (Open MPI's tree spawn with the default radix 64);
# `make test` runs the same tests on 4 hosts with radix 2. Needs root; about 3 minutes.
SCALE_HOSTS ?= 65
test-scale: system-packages setup
	DTRUN_SCALE_HOSTS=$(SCALE_HOSTS) $(BIN)/python -m pytest -m slow tests/test_scale.py

bench: setup
	mkdir -p bench-results
	$(BIN)/python benchmarks/bench_launch.py
	@if [ -f benchmarks/bench_collectives.py ]; then $(BIN)/python benchmarks/bench_collectives.py; fi
	$(BIN)/python benchmarks/bench_inplace_loop.py
	@if [ -f benchmarks/bench_doctor.py ]; then $(BIN)/python benchmarks/bench_doctor.py; fi
	$(BIN)/python benchmarks/bench_hang.py
	@if [ "$$(id -u)" = 0 ]; then $(BIN)/python benchmarks/bench_restarts.py --hosts 3; else echo "bench_restarts: needs root (namespace hosts)"; fi
	$(BIN)/python benchmarks/bench_elastic.py
	@if [ "$$(id -u)" = 0 ]; then $(BIN)/python benchmarks/bench_output.py; else echo "bench_output: needs root (namespace hosts)"; fi
	$(BIN)/python benchmarks/bench_straggler.py
	@if $(BIN)/python -c 'import torch' 2>/dev/null; then $(BIN)/python benchmarks/bench_ddp.py; \
	else echo "bench_ddp: PyTorch is not installed; skipped"; fi
	@if $(BIN)/python -c 'import torch, tensorflow' 2>/dev/null; then $(BIN)/python benchmarks/bench_horovod.py; else echo "bench_horovod: PyTorch or TensorFlow is not installed; skipped"; fi
	$(BIN)/python benchmarks/bench_dp_hosts.py
	$(BIN)/python benchmarks/bench_dp_hosts.py --rate 200mbit --layouts 2x1,3x1 --rounds 4 --steps 5

# 65-host figures: cluster up/down, launch against bare mpirun (Open MPI 5 and 4.1), doctor and
# the preflight at 1/4/16/64 hosts against parallel ssh, the links stage. Needs root.
bench-scale: setup
	mkdir -p bench-results
	$(BIN)/python benchmarks/bench_scale.py
	@if [ "$$(id -u)" = 0 ]; then $(BIN)/python benchmarks/bench_restarts.py --hosts 16; else echo "bench_restarts: needs root (namespace hosts)"; fi

# The documentation site (mkdocs.yml, docs/) into build/docs-site, with --strict: a broken link,
# a page missing from nav or a failing CLI reference page fails the build. The docs extra of
# pyproject.toml is installed into the venv the first time (without reinstalling dtrun).
DOCS_STAMP := $(VENV)/.dtrun-docs-installed
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))' > $(VENV)/docs-requirements.txt
	$(BIN)/pip install -q -r $(VENV)/docs-requirements.txt
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

cluster-up: setup
	$(BIN)/python -m tests.nscluster up $(N)

cluster-down:
	$(BIN)/python -m tests.nscluster down

clean:
	rm -rf $(VENV) bench-results .pytest_cache
