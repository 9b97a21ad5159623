"""The exception family for bad input.

Every class subclasses a built-in (ValueError, TypeError, ImportError), so callers' existing
``except`` clauses keep working; ``RopeError`` catches all of them.
"""


class RopeError(Exception):
    """Base of every error arrayrope raises for bad input or a missing backend."""


class RopeValueError(RopeError, ValueError):
    """An argument has the right type but a wrong value (shape, range, option name)."""


class RopeTypeError(RopeError, TypeError):
    """An argument has the wrong type (not an array, not a float dtype, mixed devices)."""


class BackendUnavailableError(RopeError, ImportError):
    """The requested backend needs a package or a device this process does not have."""
