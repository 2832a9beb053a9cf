# gpuagent developer entry points. Every target creates .venv as needed.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install run test bench proto clean

install: $(STAMP)

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

# scripts/test.sh: most tests on TEST_WORKERS xdist workers, then the `alone` ones; SHUFFLE=1 for a random order.
test: install
	PY=$(PY) scripts/test.sh

bench: install
	@for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b --json || exit 1; done

proto: install
	PYTHON=$(PY) scripts/gen_proto.sh

clean:
	rm -rf $(VENV) run build *.egg-info
