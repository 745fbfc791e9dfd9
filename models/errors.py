"""Errors the user must act on, raised from every layer (so they live in the lowest). The CLI prints them as one
line instead of a traceback."""


class LanternError(Exception):
    pass


class ConfigError(LanternError, ValueError):
    """A config problem; the message names the file and key."""


class NonFiniteLossError(LanternError, RuntimeError):
    """The loss became NaN/Inf: training stopped and the last good checkpoint is kept."""


class CheckpointError(LanternError, ValueError):
    """A checkpoint that cannot be used: truncated, corrupt, not Lantern's, a code-carrying pickle, or tensors
    that do not fit the model. The message names the file (and, for a mismatch, the key and both shapes)."""


class DataError(LanternError, ValueError):
    """A data file that cannot be read: the message names the file and the line (or byte offset)."""


def one_line(error: BaseException) -> str:
    """The error as the CLI prints it: one line (a multi-line message from a library is joined with ' | ')."""
    text = str(error).strip() or type(error).__name__
    if isinstance(error, OSError) and error.filename is not None and str(error.filename) not in text:
        text = f"{error.filename}: {text}"
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())
