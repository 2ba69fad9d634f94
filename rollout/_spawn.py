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


#: How long a worker may stay stopped (SIGSTOP / SIGTSTP) while it owes an answer to a call that
#: has no timeout before the call fails: it would never answer, and a hang is worse than an error.
STOPPED_LIMIT_S = 30.0


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (SIGSTOP, SIGTSTP): state ``T`` in /proc.

    A stopped worker neither answers nor dies, so only this tells it from a slow one. False
    where /proc cannot say (not Linux, the process gone).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    end = stat.rfind(b")")  # the state follows the command name, which may hold spaces or ')'
    return stat[end + 2 : end + 3] == b"T"


def note_stopped(pids: dict, halted: dict, now: float) -> None:
    """Record in ``halted`` since when each process of ``pids`` (key -> pid) has been seen
    stopped; forget those running again. A caller waiting on workers calls it when they are
    quiet, and fails the wait for one stopped too long (see ``STOPPED_LIMIT_S``)."""
    for key, pid in pids.items():
        if stopped(pid):
            halted.setdefault(key, now)
        else:
            halted.pop(key, None)


def reap(procs: Iterable[subprocess.Popen | ForkedProcess], grace: float = 5.0) -> None:
    """Waits for ``procs`` to exit, ``grace`` seconds for all of them together; kills the rest."""
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
