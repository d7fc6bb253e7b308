"""What the trainer and the critic share as executors: both train a model on prompt groups as they
stream in.

- learner.py: the Learner executor base (its units, the order it takes groups in, the device's time-sharing);
- order.py: in which order a rank takes its groups under each layout (free, ordered, lockstep);
- models.py: the model and its copies laid out over this executor's ranks, and a group's micro-batches;
- config.py: the layout, optimizer and micro-batching options both configure;
- sums.py: step sums that add over micro-batches, groups and dp ranks.
The model code they run (packing, attention, the LM head, AdamW) is the model library's: tidal/modeling/.
"""
