"""What the ``lantern`` command runs: the CLI, the pipeline of stages, and the pipeline's records,
held-out scoring and report. The top layer: it imports the stages, never the other way round."""
