# The two set-up commands of the README. Each creates .venv/ on first use.
#   make demo   - the main job: train a text classifier on every device (CPU processes without a GPU)
#   make test   - the test suite (what CI runs through .ci/run)
# and for the inner loop: make test-fast - the fast tier (no processes, kernels or browser) and the doctests
VENV        := .venv
PY          := $(VENV)/bin/python
# torch first and pinned: on this project's machines it is a CPU build already on disk; on a GPU machine
# install your CUDA build of torch into .venv first (any torch>=2.2 satisfies the project).
TORCH_SPEC  ?= torch==2.13.0
export HF_HUB_OFFLINE ?= 1

.PHONY: demo test test-fast venv

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: venv
	$(PY) -m flair_nbddp demo

test: venv
	$(PY) -m pytest -q

test-fast: venv
	$(PY) -m pytest -q -m "not process and not kernel and not browser"
