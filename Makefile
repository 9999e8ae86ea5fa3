# Two entry points for a fresh machine with only Python 3.11 and pip:
#   make demo   - the main job: a mixed-precision training run with an overflow episode
#   make test   - ruff (check + format) and the whole test suite, notebooks included (the suite
#                 builds the documentation site strictly, once: tests/test_docs_site.py)
#   make docs   - the documentation site, into site/ (mkdocs build --strict: a warning fails it)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test docs lint format bench bench-large device-check clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m demo

# Offline: no fonts, inventories or plugins that fetch anything (mkdocs.yml).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: lint
	$(PY) -m pytest -n 2 --dist loadfile

bench: $(STAMP)
	$(PY) -m benchmarks

bench-large: $(STAMP)
	$(PY) -m benchmarks --large

# The device check (benchmarks/device_check.py): CUDA when torch sees a GPU, else the CPU. On a
# machine without the venv: PYTHONPATH=. python -m benchmarks.device_check --device cuda --out DIR
device-check: $(STAMP)
	$(PY) -m benchmarks.device_check --out device_check_output --device \
		$$($(PY) -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info site
