# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch is pinned and installed first: on our machines this version comes from a local CPU wheel;
# any other version would pull gigabytes of CUDA packages. The package itself only needs torch>=2.4.
# The dev extras include gradsync[ft] (torchft 0.2, for live membership's tests), which needs torch>=2.7.
TORCH ?= torch==2.13.0

.PHONY: venv demo test check lint bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip >/dev/null || true
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/gradsync run

check: $(STAMP)
	$(BIN)/ruff check gradsync tests benchmarks examples
	$(BIN)/ruff format --check gradsync tests benchmarks examples
	$(BIN)/mypy gradsync

lint: check

test: check
	OMP_NUM_THREADS=1 $(BIN)/pytest -q

# Regenerates BENCHMARKS.md and RELIABILITY.md, one benchmark after another (they measure
# time, so they must not share the cores), and records how long each took in BENCHMARKS.md.
# 33.4 minutes on 2 cores, timed (BENCHMARKS.md, bench_run); the cluster parts need root and
# are skipped with a message otherwise.
bench: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m benchmarks.all --write

clean:
	rm -rf $(VENV) build *.egg-info
