"""One worker process of the out-of-process ``on_cpu`` executor.

Started by ``rollout._pool`` (``serve(FD)``: a fork of a template process, ``rollout/_template.py``,
or a fresh ``python _worker.py FD``) in an environment that already pins JAX to one CPU device and
one thread (``JAX_PLATFORMS=cpu``, ``JAX_NUM_CPU_DEVICES=1``,
``XLA_FLAGS=... --xla_cpu_multi_thread_eigen=false``), so W workers use W cores and no more.

Protocol over the socket ``FD`` (pickled tuples through ``multiprocessing.connection``):

- parent -> worker: ``("run", call_id, shm_name, shm_size, key, program, ins, outs, drops)``
  where ``program`` is the pickled ``jax.export.Exported`` of the chunk function (sent once per
  key) or ``None``, ``ins``/``outs`` are ``(offset, shape, dtype name)`` slices of the shared
  memory block, and ``drops`` are keys of programs to forget (the parent decides what is cached,
  so both sides agree on it); ``("close",)`` to exit.
- worker -> parent: ``("ready", pid)`` once JAX is imported, then per run ``("start", call_id)``
  once the program is compiled (a ``timeout=`` counts from here), and ``("ok", call_id)`` or
  ``("err", call_id, type_name, message, traceback_text)``. A failed run drops its program.

The worker imports nothing from the ``rollout`` package (the program arrives as StableHLO), so user
closures are never pickled and the worker starts as fast as ``import jax`` allows.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import sys
import threading
import time
import traceback

#: fn's outputs for a chunk of rows must be the full batch's, row for row. The program can also
#: predate the whole batch's trace: a value fn closes over changed in between (see on_cpu).
_SHAPE_CHANGED = (
    "fn returned output leaf {} as {} {} for this worker's chunk of rows, where the whole "
    "batch's output gives the chunk {} {}: fn must be row-independent (no output shape or "
    "dtype that depends on the batch size), with the batch on axis 0 of every output; or a "
    "value fn closes over that sets an output's shape or dtype changed since this chunk "
    "shape's program was compiled (closed-over values are frozen then): pass it as an argument"
)


def _attach(name: str, size: int):
    # Attach without multiprocessing.shared_memory: in Python < 3.13 attaching registers the block
    # with a resource tracker, which would unlink the parent's block when this worker exits.
    from multiprocessing import shared_memory

    try:
        return shared_memory.SharedMemory(name=name, track=False)  # Python >= 3.13
    except TypeError:
        pass
    from multiprocessing import resource_tracker

    register = resource_tracker.register
    resource_tracker.register = lambda *a, **k: None
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:  # an orphan is adopted by another process
        time.sleep(0.5)
    os._exit(1)  # the parent died (SIGKILL) during a call: the call's result has no reader


def _drop(programs: dict, keys) -> None:
    """Forget these compiled programs and free their memory."""
    if [programs.pop(k) for k in keys if k in programs]:
        # JAX's own caches (of jit(exported.call) and its lowering) keep every program compiled
        # here alive, with the constants fn closed over (a 100 MB table is 100 MB a program):
        # empty them. The programs still in use are held in `programs`, so they stay compiled.
        import jax

        jax.clear_caches()
        gc.collect()  # the programs sit in reference cycles: free them now, not at some later gc


def _compile(key, program: bytes | None, args: list):
    if program is None:
        raise RuntimeError(f"worker has no program for key {key!r}")
    import jax

    exported = pickle.loads(program)  # a jax.export.Exported
    return jax.jit(exported.call).lower(*args).compile()


def _write(outs: list, results: list, buf) -> None:
    """Copies the results into their slices of the shared block."""
    import numpy as np

    for j, ((off, shape, dt), res) in enumerate(zip(outs, results, strict=True)):
        # NumPy would broadcast or cast it in, silently
        if tuple(res.shape) != tuple(shape) or res.dtype != np.dtype(dt):
            raise ValueError(_SHAPE_CHANGED.format(j, res.dtype, res.shape, dt, tuple(shape)))
        np.ndarray(shape, dtype=np.dtype(dt), buffer=buf, offset=off)[...] = res


def main(fd: int) -> None:
    from multiprocessing.connection import Connection

    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()

    conn = Connection(fd)
    import jax  # noqa: F401  (imported before "ready", not in the first call)
    import numpy as np

    conn.send(("ready", os.getpid()))
    programs: dict = {}
    shm = None
    shm_name = None
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return  # parent went away: exit quietly
            if msg[0] == "close":
                return
            if msg[0] == "detach":  # the parent replaced the block: let go of the old one
                if shm is not None:
                    shm.close()
                shm = shm_name = None
                continue
            _, call_id, name, size, key, program, ins, outs, drops = msg
            _drop(programs, drops)
            try:
                if name != shm_name:
                    if shm is not None:
                        shm.close()
                    shm, shm_name = _attach(name, size), name
                buf = shm.buf
                args = [
                    np.ndarray(shape, dtype=np.dtype(dt), buffer=buf, offset=off)
                    for off, shape, dt in ins
                ]
                if key not in programs:
                    programs[key] = _compile(key, program, args)
                conn.send(("start", call_id))
                results = programs[key](*args)
                _write(outs, results, buf)
                # Drop views into the block now, so that it can be closed when it is replaced.
                args = results = buf = None
                conn.send(("ok", call_id))
            except BaseException as e:  # report everything; the parent decides what to raise
                args = results = buf = None
                _drop(programs, [key])
                conn.send(("err", call_id, type(e).__name__, str(e), traceback.format_exc()))
    finally:
        if shm is not None:
            try:
                shm.close()
            except BufferError:
                pass  # a view is still alive during interpreter teardown; the OS unmaps it


def serve(fd: int) -> None:
    """The worker's whole life, in a fresh interpreter or in a fork of a template process."""
    # Stop signals are the parent's to handle: it finishes its step, writes its checkpoint and
    # then closes us. A terminal's Ctrl-C, or a scheduler's SIGTERM, reaches every process of
    # the job, and a worker dying of it first would fail that step. We still end with the
    # parent (our socket closes, or, during a call, `_watch_parent` sees it gone) and on SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        main(fd)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the parent went away while we answered it: nothing left to tell


if __name__ == "__main__":
    serve(int(sys.argv[1]))
    # The parent waits for our exit: skip the interpreter's final collections of the objects
    # JAX (or an env's package) made, 0.1-0.2 s of CPU that only frees memory the OS takes back.
    gc.freeze()
