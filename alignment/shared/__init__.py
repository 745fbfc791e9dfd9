"""What the stages share and is not Lightning: the alignment losses and RL maths, response log-probs, rewards
and checkers, sampling, held-out statistics, and the model a stage starts from."""
