"""megatron-core for the trainer's megatron backend (trainer.backend=megatron; the tri-model itself is
tidal/executors/trainer/megatron_models.py): the HF <-> megatron weight conversion, the GPT model built
from an HF config over the trainer's own process groups, a micro-batch's log-probs through it, and
the CPU shims. Optional: `pip install -e ".[megatron]"` (megatron-core 0.16.1, the newest release
for Python 3.11)."""
