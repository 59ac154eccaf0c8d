"""Drop-ins for existing trainers. Each lives in its own module and imports its trainer library only when imported:

- ``grpo_fast.integrations.trl``: ``FastGRPOTrainer``, TRL's ``GRPOTrainer`` on grpo-fast's no-logits loss
  (needs ``pip install 'grpo-fast[trl]'``).

Importing ``grpo_fast`` or this package imports no trainer library and patches nothing.
"""
