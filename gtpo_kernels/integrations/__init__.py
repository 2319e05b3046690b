"""Adapters that put `gtpo_loss` inside existing trainers.

- `gtpo_kernels.integrations.trl`: `GTPOTrainer`, a drop-in subclass of TRL's `GRPOTrainer`
  (needs the optional extra: `pip install gtpo-kernels[trl]`).
- `gtpo_kernels.integrations.verl`: verl's `gtpo` policy loss and trainer mode (a `verl.plugins` entry point).
- `gtpo_kernels.integrations.skyrl`: SkyRL's `gtpo` policy loss and `GTPOTrainer` (the advantage step).
- `gtpo_kernels.integrations.torchtitan`: `GTPOLoss` for torchtitan's RL trainer (the fused LM head).
- `gtpo_kernels.integrations.openrlhf`: `GTPOPolicyLoss`, `GTPOExperienceMaker` and `install()`.
- `gtpo_kernels.integrations.areal`: `make_loss_fn` for AReaL's `engine.train_batch`, `add_conflict_weights`.
- `token_ppo` and `rows`: what the adapters share (the PPO term on per-token advantages; row alignment).

Submodules are imported on demand so that `import gtpo_kernels` never needs the trainers' packages.
"""
