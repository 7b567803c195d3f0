# Two commands do all set-up on a fresh machine:  make demo  |  make test
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# torch is pinned in the same pip command as everything that depends on it: an unpinned torch
# would pull a multi-GB CUDA build.
TORCH  := torch==2.13.0

.PHONY: setup data demo test bench clean-runs

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH) -e '.[dev]'
	touch $(STAMP)

data:
	@scripts/ensure-data.sh

demo: setup data
	$(BIN)/fedguide run configs/demo.yaml --out runs/demo-$$(date +%Y%m%d-%H%M%S) --sweep method.name=fedavg,feddifrc

# The suite starts about a hundred Pythons (CLI runs, Flower nodes, the device check): with the sources compiled
# once beforehand none of them compiles fedguide again, even where PYTHONDONTWRITEBYTECODE keeps them from caching.
test: setup data
	$(BIN)/python -m compileall -q -j 0 src benchmarks tests > /dev/null
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest tests -n auto --maxschedchunk 1

bench: setup data
	$(BIN)/python benchmarks/engine_overhead.py
