# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch goes first and pinned: an unpinned torch pulls a multi-GB CUDA build. GPU/NPU users who
# bring their own torch (+ torch_npu) run `make TORCH_SPEC= test`.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install test demo bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH_SPEC),$(PY) -m pip install -q $(TORCH_SPEC))
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest -q

demo: install
	$(VENV)/bin/torchrun --nproc-per-node 3 launch.py --algo grpo --output-dir runs/demo

bench: install
	$(PY) bench/channels.py

clean:
	rm -rf $(VENV) runs
