# The two newcomer commands: `make demo` and `make test`. Both create or update .venv first.
VENV  ?= .venv
PY    := $(VENV)/bin/python
# The CPU build of torch, pinned: an unpinned torch would pull a multi-GB CUDA build.
# On a GPU machine: make TORCH=torch demo
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test lint format bench gpu-check paper-table clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dipaco demo $(ARGS)

# Two workers (pytest-xdist) for most of the suite, then the tests marked serial alone (they time
# how fast a command stops, or check that the daemons their commands started are gone). Exit
# code 5 is "nothing selected" (an ARGS that picks no serial test). TEST_WORKERS=0 runs it all
# in one.
TEST_WORKERS ?= 2
test: $(STAMP) lint
	.ci/need-chromium
	.ci/need-netns
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not serial" --durations 25 $(ARGS) || [ $$? -eq 5 ]
	$(PY) -m pytest -q -m serial $(ARGS) || [ $$? -eq 5 ]

lint: $(STAMP)
	$(VENV)/bin/ruff check dipaco tests bench
	$(VENV)/bin/ruff format --check dipaco tests bench
	$(VENV)/bin/lint-imports  # docs/design.md, "Layout": floors, never-rules ([tool.importlinter])
	$(VENV)/bin/mypy  # protocols/, peer/ and coordinator/ type-checked ([tool.mypy]: its files, its strictness)

format: $(STAMP)
	$(VENV)/bin/ruff check --fix dipaco tests bench
	$(VENV)/bin/ruff format dipaco tests bench

# Every row lands in docs/benchmarks.md (about 15 minutes on 2 CPU cores).
bench: $(STAMP)
	OMP_NUM_THREADS=2 $(PY) bench/peer_throughput.py
	$(PY) bench/outer_step.py --store
	$(PY) bench/codecs.py
	$(PY) bench/scale.py
	$(PY) bench/wire.py
	$(PY) bench/communication.py

# What a session runs first when a GPU is lent to it (bench/gpu_checklist.py; --device cpu form:
# make gpu-check ARGS="--device cpu"). Rows land in docs/benchmarks.md.
gpu-check: $(STAMP)
	$(PY) bench/gpu_checklist.py $(ARGS)

# The paper's comparison at small scale (about 18 minutes on 2 CPU cores): docs/results.md.
paper-table: $(STAMP)
	$(PY) bench/paper_table.py --preset tiny $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .mypy_cache
