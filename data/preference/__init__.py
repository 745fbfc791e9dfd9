"""Preference pairs (chosen / rejected) for the reward model and DPO: records, encoding, batches, and the
datamodules."""
