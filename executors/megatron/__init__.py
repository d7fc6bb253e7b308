"""The megatron-core pieces of the trainer's megatron backend (issue 18, in progress): the HF <->
megatron weight conversion, the GPT model built from an HF config, and the CPU shims. Optional:
`pip install -e ".[megatron]"` (megatron-core 0.16.1, the newest release for Python 3.11)."""
