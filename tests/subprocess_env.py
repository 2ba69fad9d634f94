"""The environment for JAX processes the tests start (CLI runs, launchers, workers), and whether
they still run."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What configures JAX, XLA or a cluster: a started process must configure itself (or be given
# it explicitly by the test), not inherit this pytest worker's settings.
_CONFIG = ("JAX_", "XLA_", "ENSEMBLE_", "TPU_", "SLURM_", "OMPI_", "PMI", "KUBERNETES_")
# Kept: the session's compilation cache and compile-speed flags (conftest). They change how
# fast programs compile, not what they compute or where; the started processes compile many of
# the same programs.
_SPEED = (
    "XLA_FLAGS",
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without JAX/XLA/cluster configuration (but with the compile
    cache and flags), the project on ``PYTHONPATH``, unbuffered output, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k in _SPEED or not k.startswith(_CONFIG)}
    env.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (exists and is not a zombie); Linux only."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def alive_after(pids: Iterable[int], seconds: float) -> list[int]:
    """Those of ``pids`` still running once all have ended or ``seconds`` have passed."""
    pids, deadline = list(pids), time.monotonic() + seconds
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


def _proc(pid: int | str) -> tuple[int, str, str, str] | None:
    """(parent pid, state, name, command line) of a process; None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[1]), fields[0], comm, cmd


def workers_of(parent: int, kind: str) -> list[int]:
    """Live worker processes of ``parent`` of ``kind`` ('on_cpu' or 'hostenv'): its children
    started fresh (``python .../_worker.py FD``), and those forked by its template processes
    (named ``on_cpu-worker`` / ``hostenv-worker``)."""
    script = {"on_cpu": "rollout/_worker.py", "hostenv": "rollout/hostenv/_worker.py"}[kind]
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        info = _proc(pid)
        if info is None or info[1] == "Z":
            continue
        ppid, _, comm, cmd = info
        if ppid == parent and script in cmd:
            found.append(int(pid))
        elif comm == f"{kind}-worker" and (up := _proc(ppid)) is not None and up[0] == parent:
            found.append(int(pid))
    return found
