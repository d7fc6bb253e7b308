"""megatron's process groups over the trainer's own ranks.

megatron's `initialize_model_parallel` builds its groups over the whole world; in a Tidal job the
trainer owns only some of its ranks (the generator and the reward hold the others), so the trainer
hands GPTModel a ProcessGroupCollection of groups it made itself (every rank creates every group,
in the same order: docs/architecture.md "Measured here"). megatron-core 0.16 then needs parallel_state only for its global
memory buffer, set here once.
"""
from __future__ import annotations


def process_groups(*, tp, dp, single, pp=None):
    """tp: this rank's tensor-parallel group; dp: its data-parallel group; single: a group of this
    rank alone (context parallelism: not used, size 1); pp: its pipeline group (None: one stage). With
    stages, megatron's embedding group is None: the trainer keeps a tied embedding's two copies equal
    itself (tidal/modeling/megatron/stages.py), and megatron's own set-up of it moves weights to CUDA."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # DotProductAttention's scratch buffer
        parallel_state._set_global_memory_buffer()
    return ProcessGroupCollection(tp=tp, dp=dp, dp_cp=dp, tp_cp=tp, cp=single, pp=pp or single,
                                  embd=None if pp is not None else single, pos_embd=None if pp is not None else single)
