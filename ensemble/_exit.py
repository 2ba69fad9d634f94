"""The end of a command-line process."""

from __future__ import annotations

import gc
import os
import sys
from typing import NoReturn

# Set where a failed jitted call's other device parts still ran when the command stopped
# waiting for them (see device_work_left_running).
_device_work_left = False


def device_work_left_running() -> None:
    """Marks that parts of a failed jitted call still run on some devices (one waits in a
    collective for a failed one, until XLA aborts the process): :func:`exit_process` then ends
    a failed process at once, since finalising the interpreter under them crashed it ("Fatal
    Python error: PyGILState_Release", exit 134, after the command's own error line)."""
    global _device_work_left
    _device_work_left = True


def exit_process(code: int | None) -> NoReturn:
    """``sys.exit(code)`` without the interpreter's final garbage collections.

    A process that imported JAX holds some 10^5 tracked objects; the collections during
    interpreter teardown walk them all again (0.2 s after ``import jax`` alone, about 0.5 s
    after a training run on this project's CPU VM), only to free memory the OS takes back
    anyway. Frozen objects are skipped. ``atexit`` handlers (closing workers, loggers, open
    checkpoints) still run first. Only for a program's last act: garbage in reference cycles
    is no longer collected.

    A failure (a non-zero code) of one process of a multi-process run ends it at once, without
    ``atexit`` handlers, as an uncaught exception does (``ensemble.distributed``): a normal
    exit would wait at JAX's shutdown barrier (one of those handlers) for the other processes
    (up to 120 s, while they wait for it in a collective), then abort with 134, not ``code``.
    The command line has closed its run (workers, loggers, checkpoints) by then. So does a
    failed process in which :func:`device_work_left_running` was called.
    """
    if code not in (None, 0) and _device_work_left:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)
    if code not in (None, 0) and "jax" in sys.modules:
        import jax

        if jax.distributed.is_initialized() and jax.process_count() > 1:
            how = "stopped by a signal" if code in (130, 143) else "failed"
            sys.stderr.write(
                f"ensemble.distributed: process {jax.process_index()} {how} (exit code "
                f"{code}); exiting now without waiting for the other processes.\n"
            )
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 1)
    gc.freeze()
    sys.exit(code)
