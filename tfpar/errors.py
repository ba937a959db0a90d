"""The one exception type tfpar raises for bad input or an unsupported request."""


class TfparError(Exception):
    """A problem tfpar found in what it was given; the message names it and the fix."""


class NotYetSupportedError(TfparError):
    """A valid request for a feature tfpar does not implement yet (never a silent fallback)."""
