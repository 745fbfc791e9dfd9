"""What the stages share and is not Lightning: the alignment losses and RL maths, response log-probs, rewards
and checkers, sampling, and held-out statistics."""
