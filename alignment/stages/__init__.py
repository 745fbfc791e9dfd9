"""One recipe per training stage (pretrain, SFT, reward model, PPO / GRPO, DPO, rejection sampling) and
the LightningModules they train. Each recipe reads top to bottom: check the config, build data, build the
module, fit."""
