# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Each creates .venv on first use and installs what it needs. On a machine without CUDA torch
# is pinned to the CPU build (an unpinned torch would pull several GB of CUDA packages).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)
TORCH_PIN := $(if $(HAS_CUDA),torch,torch==2.13.0)

.PHONY: demo test test-gpu bench notebook install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev,demo,trl]"
	touch $(STAMP)

install: $(STAMP)

# The main job: tokenise and pack the embedded corpus, train a tiny model packed / padded /
# naive, print the comparison table, write the plot and the JSON report under outputs/.
demo: $(STAMP)
	$(VENV)/bin/packed-ce demo --output-dir outputs/demo

# CPU suite: first ruff's lint and format checks of the library (rules in pyproject.toml), then
# pytest: the Triton kernels run through the Triton interpreter on CPU tensors; the doctests
# of packed_ce and packed_ce_demo run too (tests/test_doctests.py).
test: $(STAMP)
	$(PY) -m ruff check packed_ce collators packed_ce_demo
	$(PY) -m ruff format --check packed_ce collators packed_ce_demo
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider

# On a CUDA machine, with torch/triton/transformers already there (no venv): the compiled
# kernels in fp32/bf16/fp16, N*V > 2**31, torch.compile, and the GPU end-to-end tests.
test-gpu:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m pytest -q -p no:cacheprovider -m cuda tests

# On a CUDA machine: results (JSON + PNG) go to benchmarks/results/, then the tables of
# benchmarks/README.md.
bench:
	PYTHONPATH=$(CURDIR) $(PYTHON) benchmarks/bench_cross_entropy.py --out benchmarks/results
	PYTHONPATH=$(CURDIR) $(PYTHON) benchmarks/bench_fused_linear.py --out benchmarks/results
	PYTHONPATH=$(CURDIR) $(PYTHON) benchmarks/bench_training.py --out benchmarks/results
	PYTHONPATH=$(CURDIR) $(PYTHON) benchmarks/make_tables.py

notebook: $(STAMP)
	$(PY) notebooks/execute.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
