"""The demo tasks the default pipeline trains on: the corpus, the task generators, their examples and the
checkers that score answers."""
