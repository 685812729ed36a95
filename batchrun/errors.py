"""Errors that end a command with a clear message instead of a traceback."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1  # the job failed at run time
EXIT_BAD_INPUT = 2  # bad job file, bad input or bad arguments
EXIT_STOPPED = 3  # stopped by SIGTERM/SIGINT after flushing; run the same command again to resume


class BadInput(ValueError):
    """A user mistake: a bad job file, key, column, path or argument. The CLI exits with code 2.

    The message is the whole story for the user: it names the file, the key or column, and what was expected.
    """


class JobStopped(Exception):
    """The job stopped on a signal after flushing everything it finished; rerunning resumes it."""
