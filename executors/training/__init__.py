"""What the trainer and the critic share: both train a model on prompt groups as they stream in.

- batching.py, packing.py, packed_attention.py, head.py: a group's micro-batches (padded, varlen or
  shared-prompt rows), the attention over packed rows, and the LM head in chunks;
- order.py: in which order a rank takes its groups under each layout (free, ordered, lockstep);
- optim.py: AdamW with its schedule, order-independent gradient accumulators, shard-aware clipping,
  and the optimizer's checkpoint;
- config.py: the layout, optimizer and micro-batching options both configure.
"""
