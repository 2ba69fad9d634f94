"""Runs ``python SCRIPT ARGS`` many times from one interpreter that imported the project once.

A mistake on a script's command line fails while parsing, in a few milliseconds, but a fresh
interpreter first spends about 1.8 s of CPU importing JAX and Flax: 40 such runs were a minute
of the suite's CPU. Started as a script, this process imports those modules once (without
starting a JAX backend, so it forks cleanly) and runs each request in a fork, as a fresh
``python SCRIPT ARGS`` would: ``sys.argv``, the script's folder first on ``sys.path``, run as
``__main__`` with stdin empty, ``SystemExit`` and an uncaught exception turned into the exit code
and stderr the interpreter gives, exit handlers run. What the imports print would be printed
once here, not by each run, so :class:`ForkedScripts` refuses to start if they print anything.

Protocol: one JSON request per line on stdin, ``[script, args]``; one JSON reply per line on
stdout, ``[exit_code, stdout, stderr]`` (a run past its time is killed: code ``-9``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

_TIMEOUT_S = 100
_MODULES = ("jax", "jax.numpy", "flax.linen", "flax.nnx", "optax", "numpy", "ensemble", "rollout")


def _run_as_main(script: str, args: list[str], out: int, err: int) -> None:
    """In the fork: what ``python script *args`` does, then the interpreter's own exit (its
    exit handlers, flushed output) with that code."""
    import runpy
    import traceback

    stdin = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((stdin, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    raise SystemExit(code)  # up through the server's loop: this fork ends as a script ends


def _serve() -> None:
    import importlib
    import signal
    import time

    for name in _MODULES:
        importlib.import_module(name)
    reply = sys.stdout
    print("ready", file=reply, flush=True)
    for line in sys.stdin:
        script, args = json.loads(line)
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            pid = os.fork()
            if pid == 0:
                _run_as_main(script, args, out.fileno(), err.fileno())
            deadline = time.monotonic() + _TIMEOUT_S
            while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    done = os.waitpid(pid, 0)
                    break
                time.sleep(0.01)
            code = os.waitstatus_to_exitcode(done[1])
            texts = []
            for f in (out, err):
                f.seek(0)
                texts.append(f.read().decode(errors="replace"))
        print(json.dumps([code, *texts]), file=reply, flush=True)


class ForkedScripts:
    """The test side: ``run(script, args) -> CompletedProcess``, like
    ``subprocess.run([python, script, *args], capture_output=True, text=True)``."""

    def __init__(self, cwd: str, env: dict[str, str]) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, cwd=cwd, env=env,
        )  # fmt: skip
        first = self._proc.stdout.readline()
        if first != "ready\n":
            self.close()
            raise RuntimeError(f"the script runner did not start: {self._proc.stderr.read()}")
        os.set_blocking(self._proc.stderr.fileno(), False)
        try:
            printed = os.read(self._proc.stderr.fileno(), 1 << 16).decode(errors="replace")
        except BlockingIOError:
            printed = ""
        if printed:  # each run would have printed it; a fork of this process does not
            self.close()
            raise RuntimeError(f"importing {', '.join(_MODULES)} printed: {printed}")

    def run(self, script: str, args: list[str]) -> subprocess.CompletedProcess:
        self._proc.stdin.write(json.dumps([script, args]) + "\n")
        self._proc.stdin.flush()
        code, out, err = json.loads(self._proc.stdout.readline())
        return subprocess.CompletedProcess([script, *args], code, out, err)

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=30)
        self._proc.stdout.close()
        self._proc.stderr.close()


if __name__ == "__main__":
    _serve()
