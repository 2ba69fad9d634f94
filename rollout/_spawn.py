"""Worker processes for ``on_cpu`` and the host envs: one way to start them and name their end."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable


def spawn(script: str, env: dict[str, str]) -> tuple[subprocess.Popen, socket.socket]:
    """Starts ``python -u script FD`` with one end of a socket pair; returns it and our end."""
    parent, child = socket.socketpair()
    proc = subprocess.Popen(
        [sys.executable, "-u", script, str(child.fileno())],
        env=env,
        pass_fds=(child.fileno(),),
        stdin=subprocess.DEVNULL,
    )
    child.close()
    return proc, parent


def exit_text(code: int | None, running: str) -> str:
    """How a worker ended (``running`` when it has not), e.g. 'was killed by signal SIGKILL'."""
    if code is None:
        return running
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            pass
    return f"exited with code {code}"


def reap(procs: Iterable[subprocess.Popen], grace: float = 5.0) -> None:
    """Waits for ``procs`` to exit, ``grace`` seconds for all of them together; kills the rest."""
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
