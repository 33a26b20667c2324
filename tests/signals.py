"""Signal set-up for the tests' subprocesses."""

import signal


def sigint_default() -> None:
    """``preexec_fn`` for a subprocess a test sends Ctrl-C: SIGINT handled as in a terminal, even where the test
    runner inherited it ignored (a non-interactive shell's background job ignores SIGINT, and a Python started with
    SIGINT ignored installs no ``KeyboardInterrupt`` handler, so the test's Ctrl-C would never arrive)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
