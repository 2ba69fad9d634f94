"""Worker processes for ``on_cpu`` and the host envs: one way to start them and name their end."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys


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
