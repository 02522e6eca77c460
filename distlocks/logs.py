"""Logging of expected failures: one line at WARNING, the traceback at DEBUG.

A clean-up step that cannot reach its server (leaving a wait queue, giving back a
lock while the server is down) is an expected condition: the caller already gets the
outage as an exception, and the log only has to say that this step failed and why.
A chained traceback of 25 to 110 lines per call drowns that, so the WARNING record
carries the cause on one line and the traceback goes to a DEBUG record.
"""

from __future__ import annotations

import logging

from distlocks.exceptions import LockError
from distlocks.redaction import escape_control, redact


def cause(exc: BaseException) -> str:
    """``exc`` as one line: its type and message, no credential, no control character
    (a driver's message may hold a newline, or a LOCATION)."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return escape_control(redact(text))


def log_expected(logger: logging.Logger, exc: BaseException, message: str, *args: object) -> None:
    """Log ``message % args`` and ``exc``'s cause on one line at WARNING, then the same
    with the traceback at DEBUG (only built when DEBUG is on for ``logger``).

    Only a :class:`~distlocks.exceptions.LockError` (what a backend raises for a server
    it cannot reach or that refused) is expected: anything else is a bug somewhere,
    logged at WARNING with its traceback."""
    if not isinstance(exc, LockError):
        logger.warning(message, *args, exc_info=(type(exc), exc, exc.__traceback__))
        return
    logger.warning(message + ": %s", *args, cause(exc))
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(message, *args, exc_info=(type(exc), exc, exc.__traceback__))
