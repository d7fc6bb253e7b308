"""The model library: what runs a model, below the executors that own one.

- hf.py: Hugging Face model and tokenizer loading and saving; lora.py: LoRA adapters (peft); moe.py: a
  mixture-of-experts model's routing, recorded and replayed;
- parallel/: one module per parallel transform (tp, fsdp, ep, activation checkpointing) and the mesh;
- megatron/: the megatron-core backend's model, weight conversion and forward;
- batching.py, packing.py, packed_attention.py, head.py: a prompt group as micro-batches (padded,
  varlen or shared-prompt rows), attention over packed rows, the LM head in chunks; pack_rule.py:
  shared_prompt=auto's rule, torch-free (--dry-run asks it too);
- numerics.py, exact_attention.py: model.numerics=exact, products and attention as calls of one fixed shape;
- optim.py: AdamW with its schedule, order-independent gradient accumulators, clipping, checkpoints;
- tiny/: the tiny model, its tokenizer and the task it learns, so that Tidal runs with nothing downloaded.
It imports nothing of the executors, the controller or above; the channels' payload types only.
"""
