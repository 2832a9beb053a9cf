# gpuagent developer entry points. Every target creates .venv as needed.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install run test bench proto clean nvmlemu

install: $(STAMP) nvmlemu

# The SYNTHETIC NVML emulator for tests (sim/nvmlemu/README.md): libnvidia-ml.so.1 built with the system cc
# against NVIDIA's nvml.h (PyPI nvidia-nvml-dev, in the test extra); NVMLEMU_OUT=dir builds elsewhere.
NVMLEMU_OUT ?= build/nvmlemu
nvmlemu: $(NVMLEMU_OUT)/libnvidia-ml.so.1
$(NVMLEMU_OUT)/libnvidia-ml.so.1: $(STAMP) $(wildcard sim/nvmlemu/*.c sim/nvmlemu/*.h sim/nvmlemu/*.sh)
	@sh sim/nvmlemu/build.sh $(PY) $(NVMLEMU_OUT)

# torch is installed first and pinned: an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@echo "Installing into $(VENV): torch 2.13.0 (CPU) first, then gpuagent with all extras; about a minute the first time."
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[all]'
	touch $(STAMP)

# The main job on this machine: a collector with a DuckDB file plus this node's agent.
run: install
	$(PY) -m gpuagent.local_run

# scripts/test.sh: most tests on TEST_WORKERS (4) xdist workers, then the `alone` ones; SHUFFLE=1 for a random order.
test: install
	PY=$(PY) scripts/test.sh

bench: install
	@for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b --json || exit 1; done

proto: install
	PYTHON=$(PY) scripts/gen_proto.sh

clean:
	rm -rf $(VENV) run build *.egg-info
