"""Errors that reach the user as one line: each names the violated invariant."""


class SeamlineError(Exception):
    """Base for every error seamline reports to a user without a traceback."""


class CheckpointError(SeamlineError):
    """A checkpoint is missing, corrupt, or does not match the model's config."""


class ConfigError(SeamlineError):
    """A model config names an unsupported architecture or an inconsistent shape."""


class RequestError(SeamlineError):
    """A generation request is invalid (e.g. a prompt longer than the context)."""


class OverloadedError(SeamlineError):
    """More requests wait than the server will queue: the load, not the request, is the reason."""
