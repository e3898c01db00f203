"""The one error class for a user's mistake: a bad option value, options that contradict each
other, input that does not fit them. Commands print its message as one sentence, exit with status
2 and never show a traceback for it."""


class UserError(Exception):
    """A mistake in how fastlm was called, or input it cannot use; the message is one sentence."""
