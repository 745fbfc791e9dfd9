"""Errors the user must act on. The CLI prints them as one line instead of a traceback."""


class LanternError(Exception):
    pass


class ConfigError(LanternError, ValueError):
    """A config problem; the message names the file and key."""


class NonFiniteLossError(LanternError, RuntimeError):
    """The loss became NaN/Inf: training stopped and the last good checkpoint is kept."""
