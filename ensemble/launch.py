"""Runs one program as N cooperating JAX processes on this machine (loopback only).

``python -m ensemble.launch -n 2 --devices-per-process 2 -- python train.py --flag``

starts ``python train.py --flag`` twice. Each copy gets the environment that
:func:`ensemble.distributed.initialize` (and, for the coordinator, ``jax.distributed.initialize``)
reads, so together they form one JAX runtime with ``2 x 2`` CPU devices, talking over 127.0.0.1
with gloo collectives:

==================================== ================================================
``JAX_COORDINATOR_ADDRESS``          ``127.0.0.1:<free port>`` (read by JAX too)
``JAX_COORDINATOR_BIND_ADDRESS``     the same: the coordinator listens on loopback only
``ENSEMBLE_NUM_PROCESSES``           N
``ENSEMBLE_PROCESS_ID``              0 .. N-1
``JAX_NUM_CPU_DEVICES``              ``--devices-per-process`` (read by JAX's config)
``JAX_CPU_COLLECTIVES_IMPLEMENTATION`` ``gloo`` (read by JAX's config)
==================================== ================================================

Output lines come back prefixed ``[rank k]``. If any process fails (non-zero exit or a signal),
the launcher stops the others (SIGTERM, SIGKILL after ``--grace`` seconds) and exits with that
process's code, so a crash never leaves the rest hanging in a collective. SIGINT / SIGTERM sent to
the launcher are forwarded to every process, followed by SIGKILL ``--grace`` seconds later for any
that is still running: JAX's preemption service catches SIGTERM in a distributed run and only
records it, so a process blocked in a collective would otherwise keep running. ``--timeout``
bounds the whole run (exit 124). Only 127.0.0.1 is used: the coordinator binds loopback
(``JAX_COORDINATOR_BIND_ADDRESS``) and ``ensemble.distributed.initialize`` makes gloo bind it too.

This is for trying a multi-host program on one machine and for tests. Across real hosts, start
one process per host with your cluster's tools (SLURM, Kubernetes, or by hand with the variables
above and a reachable coordinator address).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

LOOPBACK = "127.0.0.1"

__all__ = ["free_port", "launch", "main", "process_env"]


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it; loopback by default)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def process_env(
    rank: int,
    num_processes: int,
    port: int,
    devices_per_process: int | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment of process ``rank``: ``base`` (default ``os.environ``) plus the run's variables.

    Example:
      >>> env = process_env(1, 2, 1234, devices_per_process=2, base={})
      >>> env["ENSEMBLE_PROCESS_ID"], env["JAX_COORDINATOR_ADDRESS"], env["JAX_NUM_CPU_DEVICES"]
      ('1', '127.0.0.1:1234', '2')
    """
    env = dict(os.environ if base is None else base)
    address = f"{LOOPBACK}:{port}"
    env.update(
        {
            "JAX_COORDINATOR_ADDRESS": address,
            "JAX_COORDINATOR_BIND_ADDRESS": address,
            "ENSEMBLE_NUM_PROCESSES": str(num_processes),
            "ENSEMBLE_PROCESS_ID": str(rank),
            "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
            # Lines, not 4 KiB blocks, so the prefixed output interleaves as it happens.
            "PYTHONUNBUFFERED": "1",
        }
    )
    if devices_per_process is not None:
        env["JAX_NUM_CPU_DEVICES"] = str(devices_per_process)
    return env


def launch(
    command: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int | None = None,
    port: int | None = None,
    timeout: float | None = None,
    grace: float = 5.0,
    env: Mapping[str, str] | None = None,
    stdout: IO[bytes] | IO[str] | None = None,
    stderr: IO[bytes] | IO[str] | None = None,
) -> int:
    """Runs ``command`` as ``num_processes`` processes of one JAX run; returns the exit code.

    0 when every process exits 0. Otherwise the code of the first process that failed (128 + the
    signal number when it was killed by a signal), after the others were stopped; 124 when
    ``timeout`` seconds passed; 128 + signum when the launcher itself got SIGINT / SIGTERM.

    Example:
      >>> import io, sys
      >>> out = io.BytesIO()
      >>> command = [sys.executable, "-c", "import os; print(os.environ['ENSEMBLE_PROCESS_ID'])"]
      >>> launch(command, 2, stdout=out)
      0
      >>> sorted(out.getvalue().decode().splitlines())
      ['[rank 0] 0', '[rank 1] 1']
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}.")
    if devices_per_process is not None and devices_per_process < 1:
        raise ValueError(f"devices_per_process must be >= 1, got {devices_per_process}.")
    command = list(command)
    if not command:
        raise ValueError("no command given: python -m ensemble.launch -n 2 -- python train.py")
    if command[0].endswith(".py"):
        command = [sys.executable, *command]
    out = _binary(stdout or sys.stdout)
    err = _binary(stderr or sys.stderr)
    port = port or free_port()
    lock = threading.Lock()

    def note(message: str) -> None:
        with lock:
            err.write(f"[launch] {message}\n".encode())
            err.flush()

    procs: list[subprocess.Popen[bytes]] = []
    threads: list[threading.Thread] = []
    for rank in range(num_processes):
        procs.append(
            subprocess.Popen(
                command,
                env=process_env(rank, num_processes, port, devices_per_process, env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                # Own process group: we can stop a rank's whole tree (a shell, its children), and a
                # terminal's Ctrl-C reaches only us, so we decide how to pass it on.
                start_new_session=True,
                preexec_fn=_die_with_parent if _fork_is_safe() else None,
            )
        )
    for rank, proc in enumerate(procs):
        for src, dst in ((proc.stdout, out), (proc.stderr, err)):
            prefix = f"[rank {rank}] "
            t = threading.Thread(target=_pump, args=(src, dst, prefix, lock), daemon=True)
            t.start()
            threads.append(t)

    received: list[int] = []
    kill_at: list[float] = []

    def forward(signum, frame):
        received.append(signum)
        # A second Ctrl-C means "now": no grace period.
        sig = signal.SIGKILL if received.count(signal.SIGINT) > 1 else signum
        for p in procs:
            _signal_group(p, sig)
        # JAX's preemption service catches SIGTERM in a distributed run (it only records a
        # preemption notice), so a process may well survive it: SIGKILL after the grace period.
        kill_at.append(time.monotonic() + grace)

    old = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, forward)

    deadline = None if timeout is None else time.monotonic() + timeout
    code = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed and code == 0 and not received:
                rank, c = failed[0]
                code = 128 - c if c < 0 else c
                alive = [r for r, c2 in enumerate(codes) if c2 is None]
                note(
                    f"rank {rank} {_describe(c)}; stopping the other processes {alive} "
                    f"(SIGTERM, then SIGKILL after {grace:g} s)."
                )
                _stop(procs, grace)
            if all(c is not None for c in codes):
                break
            if kill_at and time.monotonic() > kill_at[0]:
                for p in procs:
                    if p.poll() is None:
                        _signal_group(p, signal.SIGKILL)
            if deadline is not None and time.monotonic() > deadline and code == 0:
                note(f"--timeout {timeout:g} s reached; stopping all processes.")
                code = 124
                _stop(procs, grace)
            time.sleep(0.05)
    finally:
        for p in procs:  # never leave a process behind, whatever happened above
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        for t in threads:
            t.join(timeout=5)
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if received and code == 0:
        code = 128 + received[0]
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point: ``python -m ensemble.launch -n N [options] -- command ...``."""
    parser = argparse.ArgumentParser(
        prog="python -m ensemble.launch",
        description="Run a command as N processes of one JAX run on this machine (loopback, "
        "gloo CPU collectives). Use ensemble.distributed.initialize() in the command.",
        epilog="example: python -m ensemble.launch -n 2 --devices-per-process 2 -- python train.py",
    )
    parser.add_argument("-n", "--num-processes", type=int, required=True)
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        help="CPU devices each process simulates (JAX_NUM_CPU_DEVICES); default: inherited",
    )
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    parser.add_argument("--timeout", type=float, default=None, help="stop everything after S s")
    parser.add_argument(
        "--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL (default 5)"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command and its arguments")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --, e.g. -- python train.py")
    try:
        return launch(
            command,
            args.num_processes,
            devices_per_process=args.devices_per_process,
            port=args.port,
            timeout=args.timeout,
            grace=args.grace,
        )
    except (ValueError, OSError) as e:
        parser.error(str(e))
        return 2  # unreachable; parser.error exits


# -- internals -------------------------------------------------------------------------------


class _TextSink:
    """Lets the pumps write bytes to a text stream (e.g. a captured sys.stdout)."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def write(self, data: bytes) -> None:
        self._stream.write(data.decode(errors="replace"))

    def flush(self) -> None:
        self._stream.flush()


def _binary(stream: Any) -> Any:
    """A bytes-accepting view of ``stream`` (binary as is, a text stream's buffer or a sink)."""
    if hasattr(stream, "buffer"):
        return stream.buffer
    try:
        stream.write(b"")
        return stream
    except TypeError:
        return _TextSink(stream)


def _pump(src: IO[bytes], dst: IO[bytes], prefix: str, lock: threading.Lock) -> None:
    head = prefix.encode()
    for line in iter(src.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            dst.write(head + line)
            dst.flush()
    src.close()


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(procs: Sequence[subprocess.Popen[bytes]], grace: float) -> None:
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGKILL)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _fork_is_safe() -> bool:
    """preexec_fn makes Python fork; unsafe once a JAX backend runs threads in this process."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    try:
        return bridge is None or not bridge.backends_are_initialized()
    except Exception:
        return False


def _die_with_parent() -> None:
    """Linux: the child gets SIGKILL if the launcher dies, so no orphan keeps a port or a core."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:
            pass


if __name__ == "__main__":
    sys.exit(main())
