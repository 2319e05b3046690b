"""Adapters that put `gtpo_loss` inside existing trainers.

- `gtpo_kernels.integrations.trl`: `GTPOTrainer`, a drop-in subclass of TRL's `GRPOTrainer`
  (needs the optional extra: `pip install gtpo-kernels[trl]`).

Submodules are imported on demand so that `import gtpo_kernels` never needs the trainers' packages.
"""
