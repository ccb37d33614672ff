"""rlkit's own exceptions: each is reported by ``rlkit`` as a short message, not a traceback."""


class RLKitError(Exception):
    """Base of the errors rlkit reports to the user without a traceback."""

    exit_code = 1


class ConfigError(RLKitError, ValueError):
    """A configuration value is wrong; the message names the key and the fix. Exit code 2."""

    exit_code = 2


class NonFiniteError(RLKitError, FloatingPointError):
    """A loss or gradient became NaN/inf; the message says where and what to try."""
