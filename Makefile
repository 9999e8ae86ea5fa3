# Two entry points for a fresh machine with only Python 3.11 and pip:
#   make demo   - the main job: GPT-2 on real text in every half format, with and without loss
#                 scaling, against float32, through both front doors (python -m demo --help)
#   make demo-distributed - the same GPT on 2 local processes per front door against one process
#                 (python -m demo --nproc 2: torch DDP over gloo, jax.distributed)
#   make test   - ruff (check + format), mypy and the whole test suite, notebooks included (the
#                 suite builds the documentation site strictly, once: tests/test_docs_site.py)
#   make docs   - the documentation site, into site/ (mkdocs build --strict: a warning fails it)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo demo-distributed test docs lint typecheck format dist bench bench-full bench-large device-check clean

# The library with its torch extra and the dev tools; torch is pinned (constraints.txt) to the
# CPU wheel cached on the project's machines. pip compiles the dependencies' bytecode (about a
# minute of one core): keep it, since these machines set PYTHONDONTWRITEBYTECODE=1 and every
# fresh process would otherwise compile each module it imports from source, every time.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m demo

# The GPT of make demo on 2 local processes per front door (torch DDP over gloo, jax.distributed),
# one rank meeting an overflow, against one process: demo_output/distributed.md and .json.
demo-distributed: $(STAMP)
	$(PY) -m demo --nproc 2

# Offline: no fonts, inventories or plugins that fetch anything (mkdocs.yml).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# tests/test_packaging.py builds both artifacts too (in a temporary folder) and checks them.
# Two workers, a file each at a time, the longest files first (tests/conftest.py: LONGEST_FIRST).
test: lint typecheck
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=25

# The sdist and the wheel, checked by twine, in dist/.
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --no-isolation --outdir dist .
	$(VENV)/bin/twine check --strict dist/*

# The quick run: every section at S, fewer rounds, groups and models (benchmarks/cli.py lists
# the cuts): 4:37 from a fresh clone with every cache cold on the 2 idle cores of the project's
# machine (docs/performance-notes.md, "The quick run's time"). bench-full gives the documented
# numbers (docs/performance.md), bench-large adds the L size to them.
bench: $(STAMP)
	$(PY) -m benchmarks

bench-full: $(STAMP)
	$(PY) -m benchmarks --full

bench-large: $(STAMP)
	$(PY) -m benchmarks --full --large

# The device check (device_check/check.py): CUDA when torch sees a GPU, else the CPU. On a
# machine without the venv: PYTHONPATH=. python -m device_check --device cuda --out DIR
device-check: $(STAMP)
	$(PY) -m device_check --out device_check_output --device \
		$$($(PY) -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache build dist *.egg-info site
