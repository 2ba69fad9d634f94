"""Worker processes forked from a template process that has already imported what they need.

A worker started as a fresh ``python _worker.py FD`` spends most of its start importing: 1.5 s of
CPU for ``import jax`` (an ``on_cpu`` worker), 3 s for ``import envpool``. A template is one such
interpreter, started once per parent process and kind of worker, that imports those modules and
the worker script and then forks a worker per request in a few milliseconds; the forks share the
imported modules' memory until they write to it. Linux only (elsewhere, and with
``ROLLOUT_FORK_WORKERS=0``, workers start fresh).

Why a template and not ``os.fork()`` of the parent: the parent holds a JAX runtime and its
threads, which a fork does not survive. The template never starts a JAX backend and has one
thread, so it forks cleanly.

What a worker sees is what a fresh interpreter would have given it: the requested environment
variables (applied in the fork), the parent's working directory at the request, its own NumPy
global generator. The template itself is shared by requests whose environments agree except in
variables that only name what runs now (``PYTEST_CURRENT_TEST``), since a variable may have
changed how a module it imported set itself up; a request with another environment starts a new
template, and the old one ends once its last worker has.

The parent (:class:`Template`, :class:`ForkedProcess`) speaks to the template over a
``SOCK_SEQPACKET`` socket pair, one pickled tuple per packet:

- parent -> template: ``("spawn", script, cwd, name, env_changes)`` with the worker's socket
  end attached (``SCM_RIGHTS``); ``("retire",)``: end once no worker is left;
- template -> parent: ``("ready",)``; ``("pid", pid)`` per spawn with a pidfd of the worker
  attached (opened before the template could reap it, so it always names that process: the
  parent sees the worker end and kills it without a pid that could have been reused);
  ``("exit", pid, code)`` once it has reaped a worker (``code`` as ``Popen.returncode``).

The template ends when the parent does (its socket closes, or it is orphaned), killing the
workers it has left, so none outlives the parent even in a step that never returns.

Run as a script, this file is the template; it imports nothing from ``rollout``.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref

_PACKET = 1 << 20
_POLL_S = 0.5  # how often the template checks that its parent is alive
_SLICE_S = 0.05  # the longest a waiting caller holds a template's lock
_CODE_WAIT_S = 5.0  # how long an ended worker's exit code may take to come from the template
#: Variables that name what runs now rather than configure it: not part of a template's key.
_VOLATILE = frozenset({"PYTEST_CURRENT_TEST"})


def enabled() -> bool:
    """Whether workers are forked from templates: on Linux with working pidfds, unless
    ``ROLLOUT_FORK_WORKERS=0``."""
    return os.environ.get("ROLLOUT_FORK_WORKERS", "1") != "0" and _pidfds_work()


@functools.cache
def _pidfds_work() -> bool:
    """Whether this kernel opens pidfds: Linux 5.3 and later do; a sandbox such as gVisor may
    answer ENOSYS, and then workers start fresh instead."""
    if sys.platform != "linux" or not hasattr(os, "pidfd_open"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Parent side


class ForkedProcess:
    """A worker forked by a :class:`Template`: the part of ``subprocess.Popen`` the pools use.
    Whether it runs comes from its pidfd, at once; its exit code from the template."""

    def __init__(self, template: Template, pid: int, pidfd: int):
        self.template, self.pid, self._pidfd = template, pid, pidfd
        self.args = f"worker {pid} forked by template {template.pid}"
        # Not at exit: the pools' exit handler still reaps through it (the OS closes it after).
        weakref.finalize(self, os.close, pidfd).atexit = False

    @property
    def returncode(self) -> int | None:
        return self.template.code(self.pid)

    def poll(self) -> int | None:
        return self._code(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._code(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def kill(self) -> None:
        if self.returncode is None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it has ended already

    def _code(self, timeout: float | None) -> int | None:
        if self.returncode is None and not select.select([self._pidfd], [], [], timeout)[0]:
            return None  # still running
        code = self.template.wait(self.pid, _CODE_WAIT_S)
        if code is None:
            raise RuntimeError(
                f"the worker template process (pid {self.template.pid}) did not report the "
                f"exit code of worker {self.pid}, which has ended"
            )
        return code


class Template:
    """One template process: ``python -u _template.py FD MODULE...`` in environment ``env``,
    which imports ``preload`` (a module that fails to import is left to the workers to report).
    Thread-safe."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...], timeout: float):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-u", os.path.abspath(__file__), str(theirs.fileno()), *preload],
            env=env,
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.pid, self.env, self._sock = self.proc.pid, dict(env), ours
        self._lock = threading.Lock()
        self._codes: dict[int, int] = {}
        with self._lock:
            msg, _ = self._next(time.monotonic() + timeout)
        if msg != ("ready",):
            self.close()
            why = "did not start in time" if self.proc.poll() is None else "failed to start"
            raise RuntimeError(f"the worker template process {why}")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None and self._sock.fileno() >= 0

    def spawn(self, script: str, fd: int, name: str, env: dict[str, str]) -> ForkedProcess:
        """Forks a worker that runs ``script``'s ``serve(fd)`` with our socket end ``fd``, in
        environment ``env`` and our working directory, named ``name`` (``ps``; 15 bytes)."""
        changes = {k: v for k, v in env.items() if self.env.get(k) != v}
        changes.update((k, None) for k in self.env if k not in env)
        with self._lock:
            payload = pickle.dumps(("spawn", script, os.getcwd(), name, changes))
            socket.send_fds(self._sock, [payload], [fd])
            while True:
                msg, fds = self._next(None)
                if msg is None:
                    raise RuntimeError(
                        f"the worker template process (pid {self.pid}) ended while starting a "
                        "worker"
                    )
                if msg[0] == "pid":
                    return ForkedProcess(self, msg[1], fds[0])

    def code(self, pid: int) -> int | None:
        with self._lock:
            return self._codes.get(pid)

    def wait(self, pid: int, timeout: float) -> int | None:
        """``pid``'s exit code once the template has reported it, or None after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:  # in short slices, so that other callers get their turns
                while pid not in self._codes:
                    until = min(deadline, time.monotonic() + _SLICE_S)
                    if self._next(until)[0] is None:
                        if self._sock.fileno() < 0:
                            # The template ended: its workers end with it (their parent is
                            # gone), with code 1, and nobody is left to tell us.
                            self._codes[pid] = 1
                        break
                if pid in self._codes:
                    return self._codes[pid]
            if time.monotonic() >= deadline:
                return None

    def retire(self) -> None:
        """Lets the template end once its last worker has (no more spawns)."""
        with self._lock:
            try:
                self._sock.send(pickle.dumps(("retire",)))
            except OSError:
                pass  # it has ended already

    def close(self) -> None:
        """Ends the template (it kills any worker still running) and waits for it."""
        with self._lock:
            self._sock.close()
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _next(self, deadline: float | None) -> tuple[tuple | None, list[int]]:
        """The template's next message and the fds sent with it, recording exits; (None, [])
        at the deadline or the template's end."""
        if self._sock.fileno() < 0:
            return None, []
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([self._sock], [], [], left)[0]:
            return None, []
        try:
            packet, fds, _, _ = socket.recv_fds(self._sock, _PACKET, 1)
        except OSError:
            packet, fds = b"", []
        if not packet:
            self._sock.close()
            return None, []
        msg = pickle.loads(packet)
        if msg[0] == "exit":
            self._codes[msg[1]] = msg[2]
        return msg, fds


_templates: dict[tuple, Template] = {}
_templates_lock = threading.Lock()


def template_for(env: dict[str, str], preload: tuple[str, ...], timeout: float) -> Template:
    """This process's template for workers that import ``preload`` in environment ``env``
    (started on first use; one with another environment is retired)."""
    key = (os.getpid(), preload)
    want = {k: v for k, v in env.items() if k not in _VOLATILE}
    with _templates_lock:
        for stale in [k for k in _templates if k[0] != os.getpid()]:
            del _templates[stale]  # a parent we were forked from owns its templates
        found = _templates.get(key)
        if found is not None and found.alive:
            if {k: v for k, v in found.env.items() if k not in _VOLATILE} == want:
                return found
            found.retire()
        found = _templates[key] = Template(env, preload, timeout)
        return found


def close_all() -> None:
    """Ends this process's templates and any worker they still run (they would end with us)."""
    with _templates_lock:
        mine = [t for k, t in _templates.items() if k[0] == os.getpid()]
        _templates.clear()
    for template in mine:
        template.close()


# ---------------------------------------------------------------------------------------------
# Template side (this file run as a script)


def _load(script: str, cache: dict) -> object:
    if script not in cache:
        spec = importlib.util.spec_from_file_location(f"_rollout_worker_{len(cache)}", script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        cache[script] = module
    return cache[script]


def _child(module: object, fd: int, request: tuple, closing: list[int]) -> None:
    """In the fork: drop the template's signal set-up and sockets, then be the worker."""
    _, _, cwd, name, changes = request
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for other in closing:
            os.close(other)
        for k, v in changes.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        os.chdir(cwd)
        with open("/proc/self/comm", "w") as f:  # our command line is the template's
            f.write(name)
        if "numpy" in sys.modules:  # a fresh interpreter's global NumPy generator differs per
            sys.modules["numpy"].random.seed()  # worker; a fork's would repeat the template's
        module.serve(fd)  # type: ignore[attr-defined]
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        children.discard(pid)
        sock.send(pickle.dumps(("exit", pid, os.waitstatus_to_exitcode(status))))


def _fork(sock: socket.socket, request: tuple, fd: int, wake: int, scripts: dict) -> int:
    module = _load(request[1], scripts)
    pid = os.fork()
    if pid == 0:
        _child(module, fd, request, [sock.fileno(), wake])
    os.close(fd)
    pidfd = os.pidfd_open(pid)  # before any waitpid of ours: it is that process's for sure
    try:
        socket.send_fds(sock, [pickle.dumps(("pid", pid))], [pidfd])
    finally:
        os.close(pidfd)
    return pid


def _serve(sock: socket.socket, wake: int, children: set[int]) -> None:
    parent, scripts, retired = os.getppid(), {}, False
    sock.send(pickle.dumps(("ready",)))
    while not (retired and not children):
        ready = select.select([sock, wake], [], [], _POLL_S)[0]
        if wake in ready:
            while True:
                try:
                    os.read(wake, 512)
                except BlockingIOError:
                    break
        _reap(sock, children)
        if os.getppid() != parent:
            return
        if sock not in ready:
            continue
        try:
            packet, fds, _, _ = socket.recv_fds(sock, _PACKET, 1)
        except OSError:
            return
        if not packet:
            return  # the parent closed us or ended
        request = pickle.loads(packet)
        if request[0] == "retire":
            retired = True
        elif request[0] == "spawn":
            children.add(_fork(sock, request, fds[0], wake, scripts))


def _main(fd: int, preload: list[str]) -> None:
    # Stop signals are the parent's to handle; we end with it (see the module docstring).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.path.pop(0)  # this file's directory: workers must not shadow the user's modules
    for name in preload:
        try:
            __import__(name)
        except Exception:
            pass  # the worker raises it where the parent reports it
    gc.freeze()  # the imports' objects: never collected here, so forks keep sharing their pages
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd is written
    signal.set_wakeup_fd(wake_w)
    sock = socket.socket(fileno=fd)
    children: set[int] = set()
    try:
        _serve(sock, wake_r, children)
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        # The parent is gone or closed us: no worker of ours may outlive it. Unreaped, their
        # pids are still theirs.
        for pid in children:
            os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    _main(int(sys.argv[1]), sys.argv[2:])
