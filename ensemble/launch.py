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
the launcher are forwarded to every process, followed by SIGKILL ``--signal-grace`` seconds later
(default 60: a training step and a checkpoint write) for any that is still running, which the
launcher then says, exiting 137: JAX's preemption service catches SIGTERM in a distributed run
and only records it, so a process blocked in a collective would otherwise keep running.
``--timeout`` bounds the whole run (exit 124). Only 127.0.0.1 is used: the coordinator binds
loopback (``JAX_COORDINATOR_BIND_ADDRESS``) and ``ensemble.distributed.initialize`` makes gloo bind
it too.

This is for trying a multi-host program on one machine and for tests. Across real hosts, start
one process per host with your cluster's tools (SLURM, Kubernetes, or by hand with the variables
above and a reachable coordinator address).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Any

LOOPBACK = "127.0.0.1"
#: Output of a process that fails *because* a peer failed (JAX's coordination service, gloo).
#: Such a process may end before the one that failed first (still tearing down), so it is
#: blamed only if no other process fails within the grace period.
PEER_FAILURE_MARKERS = (
    "another task died",
    "task has disconnected",
    "Polled an error from coordination service",
    "Pair is not connected",
    "Connection closed by peer",
    "Connection reset by peer",
)

#: Each process is a whole JAX runtime (a few hundred MB); more than this many per core only
#: share the cores, and a typo (``-n 100000``) would start processes until the machine stalls.
MAX_PROCESSES_PER_CORE = 4

__all__ = ["free_port", "launch", "main", "port_in_use", "process_env"]


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it; loopback by default).

    Example:
      >>> port = free_port()
      >>> 0 < port < 65536 and not port_in_use(port)
      True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = LOOPBACK) -> bool:
    """Whether something (e.g. another run's coordinator) listens on ``host:port``.

    Binding the port is the test: it fails while any socket listens there (on ``host`` or on
    every interface). Ports held only by closed connections (TIME_WAIT) count as free.

    Example:
      >>> import socket
      >>> with socket.socket() as s:
      ...     s.bind((LOOPBACK, 0)); s.listen()
      ...     port_in_use(s.getsockname()[1])
      True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


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
    signal_grace: float = 60.0,
    env: Mapping[str, str] | None = None,
    stdout: IO[bytes] | IO[str] | None = None,
    stderr: IO[bytes] | IO[str] | None = None,
) -> int:
    """Runs ``command`` as ``num_processes`` processes of one JAX run; returns the exit code.

    0 when every process exits 0. Otherwise the code of the first process that failed (128 + the
    signal number when it was killed by a signal), after the others were stopped; 124 when
    ``timeout`` seconds passed; 128 + signum when the launcher itself got SIGINT / SIGTERM,
    which it forwards to every process, then SIGKILLs what still runs ``signal_grace`` seconds
    later (saying so, exit code 137: a checkpoint being written then is lost); ``grace``: the
    seconds between SIGTERM and SIGKILL when it stops the others after a failure or timeout.
    "First" is the order in which the processes ended (a waiting thread per process notes it),
    so a rank that exits because another one failed is not blamed for it. A ``port`` that is
    already in use (another run's coordinator) is refused with ``OSError`` before anything
    starts: joining that run's coordinator would abort it.

    Example:
      >>> import io, sys
      >>> out = io.BytesIO()
      >>> command = [sys.executable, "-c", "import os; print(os.environ['ENSEMBLE_PROCESS_ID'])"]
      >>> launch(command, 2, stdout=out)
      0
      >>> sorted(out.getvalue().decode().splitlines())
      ['[rank 0] 0', '[rank 1] 1']
    """
    command = _checked(command, num_processes, devices_per_process, port)
    if timeout is not None and not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout}.")
    for name, value in (("grace", grace), ("signal_grace", signal_grace)):
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a number of seconds >= 0, got {value}.")
    run = _Run(_binary(stdout or sys.stdout), _binary(stderr or sys.stderr), grace, signal_grace)
    # Signals are ours to forward from before the first process starts: one that came between
    # the start and the handlers used to end the launcher itself (exit -15, not 143).
    with run.forwarding_signals():
        run.start(command, num_processes, port or free_port(), devices_per_process, env)
        return run.supervise(timeout)


def _checked(
    command: Sequence[str], num_processes: int, devices_per_process: int | None, port: int | None
) -> list[str]:
    """The command to run (``x.py`` runs with this Python); bad arguments raise before a start."""
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}.")
    cores = os.cpu_count() or 1
    if num_processes > MAX_PROCESSES_PER_CORE * cores:
        raise ValueError(
            f"num_processes={num_processes} is more than {MAX_PROCESSES_PER_CORE} per CPU core "
            f"({cores} cores) on this machine; give at most {MAX_PROCESSES_PER_CORE * cores}, "
            "and more CPU devices per process with --devices-per-process."
        )
    if devices_per_process is not None and devices_per_process < 1:
        raise ValueError(f"devices_per_process must be >= 1, got {devices_per_process}.")
    command = list(command)
    if not command:
        raise ValueError("no command given: python -m ensemble.launch -n 2 -- python train.py")
    if command[0].endswith(".py"):
        command = [sys.executable, *command]
    if port is not None:
        if not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535, got {port}.")
        if port_in_use(port):
            raise OSError(
                f"port {port} is already in use on {LOOPBACK} (another run's coordinator?); "
                "nothing was started. Pick another --port, or leave it out to use a free one."
            )
    return command


class _Run:
    """The processes of one ``launch``: their output pumps, reapers, signals and exit code."""

    def __init__(self, out: Any, err: Any, grace: float, signal_grace: float):
        self.out, self.err, self.grace, self.signal_grace = out, err, grace, signal_grace
        self.killed_late: list[int] = []  # ranks still running signal_grace after a signal
        self.lock = threading.Lock()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.threads: list[threading.Thread] = []
        self.pumps: dict[int, list[threading.Thread]] = {}
        self.ended: list[tuple[int, int]] = []  # (rank, exit code) in the order they ended
        self.followers: set[int] = set()  # ranks whose output says a peer failed
        self.received: list[int] = []  # signals the launcher got
        self.kill_at: list[float] = []  # when to SIGKILL what a forwarded signal left running

    def note(self, message: str) -> None:
        with self.lock:
            self.err.write(f"[launch] {message}\n".encode())
            self.err.flush()

    @contextlib.contextmanager
    def forwarding_signals(self) -> Iterator[None]:
        """SIGINT / SIGTERM forwarded to the processes meanwhile (from the main thread only)."""
        old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                old[sig] = signal.signal(sig, self.forward)
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def start(self, command: list[str], num_processes: int, port: int, devices, env) -> None:
        for rank in range(num_processes):
            if self.received:  # stopped while starting: start no more
                break
            self.procs.append(
                subprocess.Popen(
                    command,
                    env=process_env(rank, num_processes, port, devices, env),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    # Own process group: we can stop a rank's whole tree (a shell, its children),
                    # and a terminal's Ctrl-C reaches only us, so we decide how to pass it on.
                    start_new_session=True,
                    preexec_fn=_die_with_parent if _fork_is_safe() else None,
                )
            )
        for rank, proc in enumerate(self.procs):
            for src, dst in ((proc.stdout, self.out), (proc.stderr, self.err)):
                args = (src, dst, rank, self.lock, self.followers)
                t = threading.Thread(target=_pump, args=args, daemon=True)
                t.start()
                self.threads.append(t)
                self.pumps.setdefault(rank, []).append(t)
            reap = (proc, rank, self.ended, self.lock)
            threading.Thread(target=_reap, args=reap, daemon=True).start()

    def forward(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        # A second Ctrl-C means "now": no grace period.
        sig = signal.SIGKILL if self.received.count(signal.SIGINT) > 1 else signum
        for p in self.procs:
            _signal_group(p, sig)
        # JAX's preemption service catches SIGTERM in a distributed run (it only records a
        # preemption notice), so a process may well survive it: SIGKILL after the grace period,
        # long enough by default for a training step and a checkpoint write.
        self.kill_at.append(time.monotonic() + self.signal_grace)

    def supervise(self, timeout: float | None) -> int:
        """Waits for every process; stops them all at the first failure, a signal or timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        code, first = 0, None
        try:
            code, first = self._watch(deadline, timeout)
        finally:
            for p in self.procs:  # never leave a process behind, whatever happened above
                if p.poll() is None:
                    _signal_group(p, signal.SIGKILL)
                    p.wait()
            for t in self.threads:
                t.join(timeout=5)
        if self.received and code == 0:
            code = 128 + (signal.SIGKILL if self.killed_late else self.received[0])
        if first is not None:
            self.note(f"exit code {code}: rank {first[0]} failed first ({_describe(first[1])}).")
        return code

    def _watch(self, deadline: float | None, timeout: float | None) -> tuple[int, Any]:
        """The polling loop: ``(exit code so far, (rank, code) of the first failure or None)``."""
        code, first, failed_at = 0, None, None
        while True:
            with self.lock:
                done = list(self.ended)
            failed = [(r, c) for r, c in done if c != 0 and not self._stopped_by_us(c)]
            if failed and code == 0:
                for r, _ in failed:  # read what they printed last (a peer-failure line?)
                    for t in self.pumps[r]:
                        t.join(timeout=0.5)
                if self.received:  # one that died of a peer's stop (JAX's abort) was stopped too
                    failed = [f for f in failed if f[0] not in self.followers]
            if failed and code == 0:
                failed_at = failed_at or time.monotonic()
                waited = time.monotonic() - failed_at
                if len(done) == len(self.procs):
                    # All have ended, each blaming a peer (JAX's shutdown barrier failing aborts
                    # every process so): nobody is left to wait for, and a run whose processes
                    # all failed must not end with code 0.
                    waited = math.inf
                first = _first_failure(failed, self.followers, waited, self.grace)
            if first is not None and code == 0:
                code = self._stop_after(first, done)
            if len(done) == len(self.procs):
                return code, first
            if self.kill_at and time.monotonic() > self.kill_at[0]:
                self._kill_late()
            if deadline is not None and time.monotonic() > deadline and code == 0:
                self.note(f"--timeout {timeout:g} s reached; stopping all processes.")
                code = 124
                _stop(self.procs, self.grace)
            time.sleep(0.05)

    def _stopped_by_us(self, code: int) -> bool:
        """Whether exit ``code`` is how a process ends on a signal the launcher sent (a
        forwarded one, or its SIGKILL): a stop, not a failure. Any other code after a
        forwarded signal (a checkpoint write that failed) is one, and stops the others."""
        ours = set(self.received)
        if self.killed_late or self.received.count(signal.SIGINT) > 1:
            ours.add(signal.SIGKILL)
        return any(code in (-s, 128 + s) for s in ours)

    def _kill_late(self) -> None:
        """SIGKILLs the processes still running ``signal_grace`` after a forwarded signal,
        saying so once: whatever they were writing (a checkpoint) is lost."""
        late = [r for r, p in enumerate(self.procs) if p.poll() is None]
        for r in late:
            _signal_group(self.procs[r], signal.SIGKILL)
        if late and not self.killed_late and self.received.count(signal.SIGINT) < 2:
            self.note(
                f"ranks {late} still ran {self.signal_grace:g} s after the signal: killed "
                "(SIGKILL), so what they were writing (a checkpoint) is lost; give "
                "--signal-grace more than a training step plus a checkpoint write."
            )
        self.killed_late = self.killed_late or late

    def _stop_after(self, first: tuple[int, int], done: list[tuple[int, int]]) -> int:
        """Stops the processes still running after ``first`` failed; its exit code."""
        rank, c = first
        alive = sorted(set(range(len(self.procs))) - {r for r, _ in done})
        if alive:
            self.note(
                f"rank {rank} {_describe(c)}; stopping the other processes {alive} "
                f"(SIGTERM, then SIGKILL after {self.grace:g} s)."
            )
        else:  # they ended at the same moment: nothing left to stop
            self.note(f"rank {rank} {_describe(c)}; the other processes had ended too.")
        _stop(self.procs, self.grace)
        return 128 - c if c < 0 else c


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point: ``python -m ensemble.launch -n N [options] -- command ...``.

    Returns the exit code (see :func:`launch`); bad arguments give 2 before anything starts.

    Example:
      >>> import sys
      >>> main(["-n", "2", "--", sys.executable, "-c", "pass"])  # doctest: +SKIP
      0
      >>> main(["-n", "0", "--", sys.executable, "-c", "pass"])  # refused: nothing started
      2
    """
    parser = _Parser(
        prog="python -m ensemble.launch",
        description="Run a command as N processes of one JAX run on this machine (loopback, "
        "gloo CPU collectives). Use ensemble.distributed.initialize() in the command.",
        epilog="example: python -m ensemble.launch -n 2 --devices-per-process 2 -- python train.py",
    )
    parser.add_argument(
        "-n", "--num-processes", type=int, required=True, help="how many processes to start"
    )
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        help="CPU devices each process simulates (JAX_NUM_CPU_DEVICES); default: inherited",
    )
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop everything after SECONDS (exit 124; default: no limit)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="seconds between SIGTERM and SIGKILL when a failure stops the others (default 5)",
    )
    parser.add_argument(
        "--signal-grace",
        type=float,
        default=60.0,
        help="seconds the processes get to stop after a forwarded Ctrl-C / SIGTERM (a training "
        "step and a checkpoint write) before SIGKILL (default 60)",
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
            signal_grace=args.signal_grace,
        )
    except FileNotFoundError as e:  # the command itself
        print(f"error: cannot run {command[0]!r}: no such program ({e.strerror})", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


class _Parser(argparse.ArgumentParser):
    """Reports a mistake in one line and exits 2 (argparse would add the usage)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {message} (see python -m ensemble.launch --help)\n")


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


def _pump(
    src: IO[bytes], dst: IO[bytes], rank: int, lock: threading.Lock, followers: set[int]
) -> None:
    """Copies a process's output line by line, prefixed ``[rank k]``; notes peer-failure lines."""
    head = f"[rank {rank}] ".encode()
    markers = [m.encode() for m in PEER_FAILURE_MARKERS]
    for line in iter(src.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            if any(m in line for m in markers):
                followers.add(rank)
            dst.write(head + line)
            dst.flush()
    src.close()


def _first_failure(
    failed: list[tuple[int, int]], followers: set[int], waited: float, patience: float
) -> tuple[int, int] | None:
    """The (rank, code) to blame among ``failed`` (in exit order), or None to wait a little.

    The first to end that did not report a failed peer; if all of them did, their peer is
    probably still ending: wait up to ``patience`` seconds for it, then blame the first.
    """
    roots = [f for f in failed if f[0] not in followers]
    if roots:
        return roots[0]
    return failed[0] if waited >= patience else None


def _reap(proc: subprocess.Popen[bytes], rank: int, ended: list, lock: threading.Lock) -> None:
    """Waits for one process and notes it in ``ended`` the moment it ends (exit order)."""
    code = proc.wait()
    with lock:
        ended.append((rank, code))


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
    from ensemble._exit import exit_process

    exit_process(main())
