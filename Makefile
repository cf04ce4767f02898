# The two set-up commands of the README. Each creates .venv/ on first use.
#   make demo   - the main job: train a text classifier on every device (CPU processes without a GPU)
#   make test   - the test suite (what CI runs through .ci/run)
# and for the inner loop: make test-fast - the fast tier (no processes, kernels, browser or cluster) and the doctests;
# make docs - the documentation site, built into site/ in strict mode
VENV        := .venv
PY          := $(VENV)/bin/python
# torch first, only when .venv has none, as `pip install $(TORCH)`: pip takes it from its index (PyPI's Linux
# build bundles CUDA and also runs on CPU; this project's machines serve a CPU build from disk). To choose,
# install your torch into .venv first, or e.g. make demo TORCH="torch --index-url https://download.pytorch.org/whl/cpu"
TORCH       ?= torch==2.13.0
export HF_HUB_OFFLINE ?= 1

.PHONY: demo test test-fast docs venv

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: venv
	$(PY) -m flair_nbddp demo

# two test processes (pytest-xdist), then the cluster tier on its own, until runs in two processes have shown
# the mend of its one failure there (a restarted rank's Dask client; docs/development.md)
test: venv
	$(PY) -m pytest -q --durations=20 -n 2 -m "not cluster"
	$(PY) -m pytest -q --durations=5 -m cluster

test-fast: venv
	$(PY) -m pytest -q -m "not process and not kernel and not browser and not cluster and not docs"

docs: venv
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict
