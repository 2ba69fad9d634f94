"""8 simulated CPU devices for every test and docstring example, set before anything touches a
JAX backend."""

import atexit
import os
import shutil
import tempfile

import pytest

# One thread per simulated device keeps 8 devices on 2 cores from oversubscribing. The suite
# compiles hundreds of small programs and runs most of them a few times, and compiling is most of
# its time, so two flags buy compile speed with code speed: LLVM at -O1 compiles a conv net's
# programs several times faster (ResNet-18's init: 12 s -> 2-3 s), and XLA's older fusion code
# generator (not the MLIR fusion emitters) cuts the CPU time of compiling a PPO learner by about
# a quarter, with the same speed of its update. Neither touches sharding propagation or the SPMD
# partitioner, so the collectives the tests look for are the same; the fusion flag does change
# which elementwise ops XLA fuses (a learner update's temp buffers: 66,864 -> 66,928 bytes),
# which the memory tests' bounds and ratios allow for. Benchmarks compile with XLA's defaults.
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_cpu_multi_thread_eigen=false --xla_backend_optimization_level=1 "
    "--xla_cpu_use_fusion_emitters=false",
)

# One persistent compilation cache per test session, shared by the pytest-xdist workers and the
# CLI and worker processes the tests start (they inherit the environment): the same learner
# programs are compiled in many of them. The first process to import this file makes it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="sharded-ensembles-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# Every process the session starts (workers, CLI runs, what an env forks) inherits this mark, so
# the session can tell at its end whether any of them outlived it. A pytest-xdist worker keeps
# its controller's.
_MARK = "SHARDED_ENSEMBLES_TEST_SESSION"
if "PYTEST_XDIST_WORKER" not in os.environ:
    os.environ[_MARK] = f"{os.getpid()}-{os.urandom(4).hex()}"

import jax  # noqa: E402  (after the environment above is set)

jax.config.update("jax_num_cpu_devices", 8)
# Started now: the CLI's main() called in-process sets the device count itself while JAX has not
# started, so an xdist worker whose first test was such a run kept that count (2 on a 2-core
# machine) and later tests in it found D=2 instead of 8.
jax.devices()


def _marked_processes() -> tuple[list[str], bool]:
    """Live processes (not zombies) other than this one that carry this session's mark, and
    whether some process could not be told yet: one caught mid-exec (its new image mapped, its
    environment not yet written, for a moment after ``Popen`` returns) reads an empty one."""
    want = f"{_MARK}={os.environ[_MARK]}".encode()
    found, unsure = [], False
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            state, ppid, flags = fields[0], int(fields[1]), int(fields[6])
            if not environ and state != "Z" and not flags & 0x00200000:  # not a kernel thread
                unsure = True
            if want not in environ.split(b"\0"):
                continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            if state == "Z" or (ppid == os.getpid() and "resource_tracker" in cmd):
                continue  # multiprocessing's tracker of this process ends when it does
            found.append(f"pid {entry.name}: {cmd[:200]}")
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return found, unsure


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: absent with -p no:xdist
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one test process more than the cores (at most 4). A good part of many tests
    is waiting (a CLI subprocess starting, env workers stepping, a signal's delivery), so on
    this project's 2-core VM a third process ran the slowest test files in 122 s instead of 131."""
    return min(4, (os.cpu_count() or 1) + 1)


@pytest.hookimpl(trylast=True)  # after pytest-xdist has stopped its workers
def pytest_sessionfinish(session, exitstatus):
    """Fails the run if a process the tests started outlives them (given a few seconds)."""
    if hasattr(session.config, "workerinput") or not os.path.isdir("/proc"):
        return  # a pytest-xdist worker (the controller checks once all are gone), or no /proc
    import sys
    import time

    if "rollout._template" in sys.modules:  # run without pytest-xdist: this process's own
        sys.modules["rollout._template"].close_all()  # templates would end only with it

    start = time.monotonic()
    grace = float(os.environ.get("SHARDED_ENSEMBLES_TEST_GRACE_S", "10"))
    while True:
        left, unsure = _marked_processes()
        # An unsure process (one with no environment, say) is given 2 s to show one.
        if time.monotonic() - start >= (grace if left else min(grace, 2) if unsure else 0):
            break
        time.sleep(0.1)
    if left:
        title = "processes started by the tests outlived them"
        report = session.config.pluginmanager.get_plugin("terminalreporter")
        if report is None:
            print(f"\n{title}:\n" + "\n".join(left))
        else:
            report.section(title, red=True, bold=True)
            for line in left:
                report.line(line, red=True)
        session.exitstatus = 1


NUM_DEVICES = 8
