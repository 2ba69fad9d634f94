"""Worker processes for ``on_cpu`` and the host envs: one way to start them and name their end."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable

from rollout._template import ForkedProcess, enabled, template_for


def spawn(
    script: str, env: dict[str, str], name: str, preload: tuple[str, ...], timeout: float
) -> tuple[subprocess.Popen | ForkedProcess, socket.socket]:
    """Starts a worker running ``script``'s ``serve(FD)`` with one end of a socket pair; returns
    the process and our end. On Linux the worker is forked from this process's template for
    ``env`` (which imports ``preload`` once, started within ``timeout`` seconds) and named
    ``name``; elsewhere it is a fresh ``python -u script FD``."""
    parent, child = socket.socketpair()
    if enabled():
        try:
            template = template_for(env, preload, timeout)
            proc = template.spawn(script, child.fileno(), name, env)
        except RuntimeError:
            pass  # no template (its stderr says why): a fresh worker reports its own failure
        else:
            child.close()
            return proc, parent
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


def reap(procs: Iterable[subprocess.Popen | ForkedProcess], grace: float = 5.0) -> None:
    """Waits for ``procs`` to exit, ``grace`` seconds for all of them together; kills the rest."""
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
