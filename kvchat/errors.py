"""User-facing errors.

Every failure a user can cause (a missing model, a bad script, a broken settings
file...) is raised as a `KvchatError` whose message says what happened and what
to do. The edges (CLI, TUI, headless) catch it and show the message, never a
traceback; anything else is a bug and goes to the error log.
"""


class KvchatError(Exception):
    """An error with a message meant for the user, saying what to do next."""


class ModelLoadError(KvchatError):
    """The model could not be found, read, or is of an unsupported kind."""


class PromptTooLongError(KvchatError):
    """A prompt does not fit in the model's context window."""


class UsageError(KvchatError):
    """Bad input on the command line, in a script or in the settings file (exit status 2)."""
