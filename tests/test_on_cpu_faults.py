"""rollout.on_cpu under bad input and failures: clear errors, every dtype, dead and slow workers,
timeouts, bounded caches. References are the direct computation (fn called without on_cpu)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing import Pipe

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from subprocess_env import alive, alive_after

import rollout
from rollout import on_cpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W = 2
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def spin(x, n):
    """Runs ``n`` dependent iterations per row: as long as we like, whatever the load."""

    def body(c):
        return c[0] * 1.0000001 + jnp.sin(c[0]) * 1e-7, c[1] + 1

    return jax.lax.while_loop(lambda c: c[1] < n, body, (x, jnp.int32(0)))[0]


def same(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype)
    np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------------------ bad input


@pytest.mark.timeout(60)
def test_out_of_range_in_axes_is_an_error_and_negative_axes_work():
    f = on_cpu(lambda x: x * 2, in_axes=1, workers=W)
    with pytest.raises(
        ValueError, match=r"in_axes=1 is out of range for args\[0\] of shape \(5,\)"
    ):
        f(jnp.ones(5))
    f3 = on_cpu(lambda x: x * 2, in_axes=3, workers=W)
    with pytest.raises(ValueError, match=r"in_axes=3 .* shape \(4, 5\) \(2-D\).*\[-2, 1\]"):
        jax.jit(f3)(jnp.ones((4, 5)))
    with pytest.raises(ValueError, match=r"in_axes=-3 is out of range"):
        on_cpu(lambda x: x, in_axes=-3, workers=W)(jnp.ones((4, 5)))
    with pytest.raises(ValueError, match=r"in_axes for args\[0\] is 0.5"):
        on_cpu(lambda x: x, in_axes=(0.5,), workers=W)(jnp.ones((4, 5)))
    with pytest.raises(ValueError, match=r"in_axes must be an int, None, or a tuple"):
        on_cpu(lambda x: x, in_axes=0.5, workers=W)(jnp.ones((4, 5)))
    with pytest.raises(ValueError, match=r"args\[0\] is a scalar"):
        on_cpu(lambda x: x, workers=W)(jnp.float32(1))
    with pytest.raises(ValueError, match=r"in_axes\[0\] = \{'b': 0\} is not a prefix"):
        on_cpu(lambda p: p["a"], in_axes=({"b": 0},), workers=W)({"a": jnp.ones(3)})
    # Negative axes count from the end, like jax.vmap: -1 on (T, B) maps over B.
    x = jax.random.normal(jax.random.key(0), (6, 5))  # time-major: 5 rows of 6 steps
    neg = on_cpu(lambda x: jnp.cumsum(x, axis=0).T, in_axes=-1, workers=W)  # out: rows first
    want = np.cumsum(np.asarray(x).T, axis=1)  # per row, computed by NumPy
    np.testing.assert_allclose(neg(x), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jax.jit(neg)(x), want, rtol=1e-5, atol=1e-5)
    neg.close()


@pytest.mark.timeout(60)
def test_batch_size_mismatch_names_the_arguments():
    f = on_cpu(lambda p, x: x * p["w"][:, None], workers=W)  # forgot in_axes=(None, 0)
    with pytest.raises(ValueError) as err:
        jax.jit(f)({"w": jnp.ones(3)}, jnp.ones((5, 2)))
    msg = str(err.value)
    assert "args[0]['w'] has 3 (axis 0 of shape (3,))" in msg, msg
    assert "args[1] has 5 (axis 0 of shape (5, 2))" in msg, msg
    assert "in_axes=None" in msg, msg


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", [0, -1, "5", float("inf"), float("nan"), True])
def test_bad_timeout_refused_at_construction(bad):
    with pytest.raises(ValueError, match="timeout must be a positive, finite number"):
        on_cpu(lambda x: x, timeout=bad)


@pytest.mark.timeout(30)
def test_bad_workers_and_cache_size_refused():
    with pytest.raises(ValueError, match="workers must be a positive int"):
        on_cpu(lambda x: x, workers="2")
    with pytest.raises(ValueError, match="cache_size must be a positive int"):
        on_cpu(lambda x: x, cache_size=0)
    too_many = 4 * rollout._devices.available_cores() + 1  # 500 once hung a 2-core machine
    with pytest.raises(ValueError, match=r"more than 4 per CPU core"):
        on_cpu(lambda x: x, workers=too_many)


# ------------------------------------------------------------------------------ dtypes

DTYPES = ["bfloat16", "float16", "int8", "uint8", "int16", "int32", "bool", "complex64"]


def dtype_fn(x, s):
    """Row-wise, exact in every dtype (integers wrap the same way on both paths)."""
    if x.dtype == jnp.bool_:
        return {"y": x ^ s, "n": jnp.sum(x, axis=1)}
    return {"y": x * s + x, "first": x[:, :1]}


def dtype_inputs(name, rows=5):
    vals = np.arange(rows * 3).reshape(rows, 3) % 7 - 3
    if name == "bool":
        return jnp.asarray(vals > 0), jnp.bool_(True)
    if name.startswith("uint"):
        vals = np.abs(vals) * 40  # 120 * 3 overflows uint8: wraps identically on both paths
    return jnp.asarray(vals).astype(name), jnp.asarray(3).astype(name)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("executor", ["process", "inprocess"])
def test_every_dtype_round_trips(executor):
    f = on_cpu(dtype_fn, in_axes=(0, None), workers=W, executor=executor)
    try:
        for name in DTYPES:
            x, s = dtype_inputs(name)
            want = dtype_fn(x, s)
            for call in (f, jax.jit(f)):
                got = call(x, s)
                for k in want:
                    same(got[k], want[k])
    finally:
        f.close()


@pytest.mark.timeout(120)
def test_sub_byte_dtypes_round_trip_through_processes_and_are_refused_in_process():
    """int4 and friends: the process executor carries them; XLA refuses their layout when
    the in-process executor calls its compiled program, so that is one clear error."""
    f = on_cpu(dtype_fn, in_axes=(0, None), workers=W)  # auto: process for a CPU caller
    inprocess = on_cpu(dtype_fn, in_axes=(0, None), workers=W, executor="inprocess")
    try:
        for name in ("int4", "uint4"):
            x, s = dtype_inputs(name) if name == "int4" else (jnp.full((5, 3), 9, name), 1)
            s = jnp.asarray(s).astype(name)
            want = dtype_fn(x, s)
            for call in (f, jax.jit(f)):
                got = call(x, s)
                for k in want:
                    same(got[k], want[k])
            with pytest.raises(TypeError, match=f"cannot take {name} arrays: XLA refuses sub-byte"):
                inprocess(x, s)
    finally:
        f.close()
        inprocess.close()


SUB_BYTE_SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from rollout import on_cpu
mesh = jax.make_mesh((8,), ("b",))  # Explicit axes: on_cpu reshards its inputs and outputs
f = on_cpu(lambda x: x.astype(jnp.int32) + 1, workers=2)
for name in ("int4", "uint4"):
    x = jax.device_put(jnp.full((16, 3), 5, name), NamedSharding(mesh, P("b")))
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(x)), np.full((16, 3), 6))
f.close()
# 2-bit outputs (XLA's CPU reshard of them gave wrong values or a heap corruption), and rows
# padded to the devices (4 rows over a 4 x 2 mesh), every value of each dtype.
same = on_cpu(lambda x, s: (x, x.astype(jnp.int32) + s), in_axes=(0, None), workers=2)
for name, vals in (("int2", [-2, -1, 0, 1]), ("uint2", [0, 1, 2, 3]), ("int4", [-8, 7, 0, 3])):
    for m, spec, rows in ((mesh, P("b"), 64), (jax.make_mesh((4, 2), ("a", "c")), P("a"), 4)):
        v = np.resize(vals, (rows, 1))
        x = jax.device_put(jnp.asarray(v).astype(name), NamedSharding(m, spec))
        y, z = jax.jit(same)(x, 1)
        assert y.dtype == name, y.dtype
        np.testing.assert_array_equal(np.asarray(y).astype(int), v)
        np.testing.assert_array_equal(np.asarray(z), v + 1)
same.close()
print("ok")
"""


@pytest.mark.timeout(120)
def test_sub_byte_inputs_from_a_program_over_several_devices_do_not_hang():
    """Such a program's callback got its int4 inputs as jax.Arrays, whose conversion to NumPy
    ran on the devices waiting for that callback: the call never returned."""
    env = dict(ENV, JAX_NUM_CPU_DEVICES="8")
    res = subprocess.run(
        [sys.executable, "-c", SUB_BYTE_SHARDED], capture_output=True, text=True, timeout=90,
        env=env,
    )  # fmt: skip
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


INT64 = """
import jax, jax.numpy as jnp, numpy as np
from rollout import on_cpu
g = on_cpu(lambda x: x + 1, workers=2, executor="process")
np.testing.assert_array_equal(g(np.ones((4, 2))), np.full((4, 2), 2, np.float32))  # x64 off
jax.config.update("jax_enable_x64", True)  # the running workers are restarted to match
x = jnp.asarray(np.arange(12).reshape(4, 3) * (2**40 + 1), jnp.int64)
fn = lambda x: x * 3 + 2**33
for ex in ("process", "inprocess"):
    f = on_cpu(fn, workers=2, executor=ex)
    for g in (f, jax.jit(f)):
        y = g(x)
        assert y.dtype == jnp.int64, y.dtype
        np.testing.assert_array_equal(y, np.asarray(x) * 3 + 2**33)
    f.close()
# One wrapper called before and after x64 changes: each setting gets its own program.
jax.config.update("jax_enable_x64", False)
third = on_cpu(lambda x: jnp.asarray(x, float) / 3, workers=2)
assert third(np.arange(1, 5, dtype=np.int32)).dtype == np.float32
jax.config.update("jax_enable_x64", True)
y = third(np.arange(1, 5, dtype=np.int32))
assert y.dtype == np.float64 and float(y[0]) == 1 / 3, (y.dtype, float(y[0]))
print("ok", flush=True)
"""


def test_python_scalars_stay_weakly_typed():
    """``2 * int8`` is int8 in JAX (a Python scalar is weak); through on_cpu too."""
    x8 = np.array([100, 1, -100], np.int8)
    xb = jnp.ones(3, jnp.bfloat16)
    for executor in ("process", "inprocess"):
        f = on_cpu(lambda w, x: x * w, in_axes=(None, 0), workers=W, executor=executor)
        for g in (f, jax.jit(f)):
            same(g(2, x8), (lambda w, x: x * w)(2, x8))  # int8, wrapping: [-56, 2, 56]
            assert g(0.5, xb).dtype == jnp.bfloat16
        f.close()


@pytest.mark.parametrize("executor", ["process", "inprocess"])
@pytest.mark.parametrize(
    "option, other", [("jax_threefry_partitionable", None), ("jax_random_seed_offset", 1)]
)
def test_a_changed_jax_setting_compiles_again_as_jax_jit_does(executor, option, other):
    # A wrapper once kept the program traced under the earlier setting: after the option
    # changed, its random draws were those of the old setting.
    def row(key, r):  # a given key, and one of its own
        return r + jax.random.uniform(key, r.shape) + jax.random.normal(jax.random.key(7), r.shape)

    def draw(keys, x):  # fn sees a batch of rows
        return jax.vmap(row)(keys, x)

    keys = jax.random.split(jax.random.key(0), 4)
    x = np.zeros((4, 3), np.float32)
    f = on_cpu(draw, workers=W, executor=executor)
    plain = jax.jit(draw)
    before = getattr(jax.config, option)
    other = (not before) if other is None else other
    try:
        for setting in (before, other, before):
            jax.config.update(option, setting)
            want = np.asarray(plain(keys, x))
            for g in (f, jax.jit(f)):
                np.testing.assert_array_equal(np.asarray(g(keys, x)), want, err_msg=str(setting))
    finally:
        jax.config.update(option, before)
        f.close()


@pytest.mark.timeout(120)
def test_int64_round_trips_with_x64():
    env = dict(ENV, JAX_NUM_CPU_DEVICES="2")
    res = subprocess.run(
        [sys.executable, "-c", INT64], capture_output=True, text=True, timeout=100, env=env
    )
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


INTERRUPTED = textwrap.dedent(
    """
    import os, signal, threading
    import jax, jax.numpy as jnp, numpy as np
    import rollout

    # As in a terminal's Python: a parent that ignores SIGINT (seen under pytest-xdist in CI)
    # would otherwise hand that on, and the signal below would never arrive.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def slow(x, n):  # n steps of work whose result depends on x
        return jax.lax.fori_loop(0, n, lambda i, c: c + 1e-7 * jnp.tanh(c), x)

    g = rollout.on_cpu(slow, in_axes=(0, None), workers=2)
    a, b = (jnp.full((4, 8), 1.0), 100_000_000), (jnp.full((4, 8), 100.0), 3_000_000)
    want_b = np.asarray(g(*b))  # also compiles
    # a's work takes seconds (a tenth of a second for b): the signal comes while it runs.
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        g(*a)
        print("not interrupted")
    except KeyboardInterrupt:
        pass
    np.testing.assert_array_equal(np.asarray(g(*b)), want_b)  # not g(a)'s late answer

    # Another function on the same pool: its arrays lie where the interrupted call's workers
    # would write their late outputs (the shared block is reused), so those workers are
    # stopped, not left to overwrite this call's inputs (it returned NaN for every row).
    f = rollout.on_cpu(lambda x: slow(x, 100_000_000) * 0 + jnp.nan, workers=2)
    add = rollout.on_cpu(lambda p, q: p + q, workers=2)
    p, q = np.ones(1024, np.float32), np.full(1024, 2.0, np.float32)
    np.testing.assert_array_equal(np.asarray(add(p, q)), p + q)
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        f(np.ones(1024, np.float32))
        print("not interrupted")
    except KeyboardInterrupt:
        pass
    np.testing.assert_array_equal(np.asarray(add(p, q)), p + q)
    print("ok")
    """
)


@pytest.mark.timeout(150)
def test_a_call_after_an_interrupted_one_gets_its_own_result():
    env = dict(ENV, JAX_NUM_CPU_DEVICES="2")
    res = subprocess.run(
        [sys.executable, "-c", INTERRUPTED], capture_output=True, text=True, timeout=140, env=env
    )
    assert res.returncode == 0 and res.stdout.split() == ["ok"], res.stdout + res.stderr[-3000:]


INTERRUPTED_START = textwrap.dedent(
    """
    import os, signal
    import jax.numpy as jnp, numpy as np
    import rollout
    from rollout import _pool

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal's Python
    started = []
    real_init = _pool._Worker.__init__

    def init_then_ctrl_c(self, *args):  # Ctrl-C once the first of the workers has started
        real_init(self, *args)
        started.append(self.pid)
        if len(started) == 1:
            os.kill(os.getpid(), signal.SIGINT)

    _pool._Worker.__init__ = init_then_ctrl_c
    f = rollout.on_cpu(lambda x: x * 2.0, workers=2, executor="process")
    x = np.arange(4.0, dtype=np.float32)
    try:
        f(x)
        print("not interrupted")
    except KeyboardInterrupt:
        pass
    _pool._Worker.__init__ = real_init
    g = rollout.on_cpu(lambda x: x + 1.0, workers=2, executor="process")  # the same pool
    np.testing.assert_array_equal(np.asarray(f(x)), x * 2)
    np.testing.assert_array_equal(np.asarray(g(x)), x + 1)
    print(started[0] not in f.pids, "ok")
    """
)


@pytest.mark.timeout(150)
def test_a_call_after_one_interrupted_while_its_workers_start_starts_them_again():
    # The pool was left holding placeholders for the workers not yet started, so every later
    # call of every wrapper on it failed ("'NoneType' object has no attribute 'proc'").
    env = dict(ENV, JAX_NUM_CPU_DEVICES="1")
    res = subprocess.run([sys.executable, "-c", INTERRUPTED_START], capture_output=True,
                         text=True, timeout=140, env=env)  # fmt: skip
    assert res.returncode == 0 and res.stdout.split() == ["True", "ok"], (
        res.stdout + res.stderr[-3000:]
    )


# ------------------------------------------------------------------------------ failures


def _kill_when_busy(f, delay, box):
    """Kill worker 1 ``delay`` s after the pool starts a call (its lock is taken)."""
    pool = f._executor("process")
    while not pool._lock.locked():
        time.sleep(0.01)
    time.sleep(delay)
    box["victim"] = f.pids[1]
    box["t"] = time.monotonic()
    os.kill(box["victim"], signal.SIGKILL)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("jitted", [False, True])
def test_worker_killed_mid_call_raises_worker_error_promptly(jitted):
    f = on_cpu(spin, in_axes=(0, None), workers=W, executor="process", timeout=60)
    call = jax.jit(f) if jitted else f
    x = jnp.ones((4, 3))
    try:
        same(call(x, 10), spin(x, 10))  # workers up and the program compiled
        box: dict = {}
        killer = threading.Thread(target=_kill_when_busy, args=(f, 0.5, box))
        killer.start()
        with pytest.raises(rollout.WorkerError) as err:
            with rollout.worker_errors():
                call(x, 2**31 - 1).block_until_ready()
        late = time.monotonic() - box["t"]
        killer.join()
        assert rf"pid {box['victim']}) was killed by signal SIGKILL" in str(err.value)
        assert str(err.value).startswith("on_cpu(spin): ")  # whose fn: the pool is shared
        assert late < 3.0, f"reported {late:.1f} s after the kill (documented: within 1 s)"
        if jitted:  # raised again from JAX's error, which stays attached
            assert err.value.__cause__ is not None
        same(call(x, 10), spin(x, 10))  # the pool restarts
        assert len(f.pids) == W and box["victim"] not in f.pids
    finally:
        f.close()


@pytest.mark.timeout(120)
def test_worker_error_without_the_context_manager_still_names_it(monkeypatch):
    f = on_cpu(lambda x: x + 1, workers=W, executor="process")
    try:
        monkeypatch.setattr(type(f), "_exported", lambda self, *a: b"not a program")
        with pytest.raises(rollout.WorkerError, match="raised UnpicklingError"):
            f(jnp.ones((3, 2)))  # eager: the WorkerError itself
        with pytest.raises(Exception, match=r"WorkerError: .*raised UnpicklingError") as err:
            jax.jit(f)(jnp.ones((3, 2))).block_until_ready()
        assert not isinstance(err.value, rollout.WorkerError)  # JAX's wrapper, as documented
        monkeypatch.undo()
        same(f(jnp.ones((3, 2))), jnp.full((3, 2), 2.0))
    finally:
        f.close()


@pytest.mark.timeout(180)
def test_dead_idle_workers_all_replaced():
    f = on_cpu(lambda x: x * 3, workers=W, executor="process")
    try:
        x = jnp.arange(10.0).reshape(5, 2)
        same(f(x), x * 3)
        old = f.pids
        for pid in old:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.3)
        same(jax.jit(f)(x), x * 3)
        assert len(f.pids) == W and not set(old) & set(f.pids)
    finally:
        f.close()


# ------------------------------------------------------------------------------ timeouts


@pytest.mark.timeout(180)
@pytest.mark.parametrize("jitted", [False, True])
def test_process_timeout_fires_on_time_and_the_wrapper_stays_usable(jitted):
    f = on_cpu(spin, in_axes=(0, None), workers=W, executor="process", timeout=1.0)
    call = jax.jit(f) if jitted else f
    x = jnp.ones((4, 3))
    try:
        same(call(x, 10), spin(x, 10))  # compiled: the next call only executes
        t0 = time.monotonic()
        with pytest.raises(rollout.WorkerTimeout, match=r"did not finish within timeout=1 s"):
            with rollout.worker_errors():
                call(x, 2**31 - 1).block_until_ready()
        took = time.monotonic() - t0
        assert took < 3.0, f"timeout=1 fired after {took:.1f} s"
        same(call(x, 10), spin(x, 10))
        same(call(x, 12), spin(x, 12))
    finally:
        f.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("timeout", [1.0, None])
def test_a_stopped_worker_fails_the_call_within_its_limit(timeout, monkeypatch):
    """A SIGSTOPped worker neither answers nor dies: with ``timeout=`` the call fails after it,
    without one after ``STOPPED_LIMIT_S`` (shortened here), never a hang; the next call works."""
    import rollout._pool

    monkeypatch.setattr(rollout._pool, "STOPPED_LIMIT_S", 1.5)
    f = on_cpu(spin, in_axes=(0, None), workers=W, executor="process", timeout=timeout)
    x = jnp.ones((4, 3))
    try:
        same(f(x, 10), spin(x, 10))
        victim = f.pids[1]
        os.kill(victim, signal.SIGSTOP)
        kind = rollout.WorkerTimeout if timeout else rollout.WorkerError
        what = "timeout=1 s" if timeout else "1.5 s"
        start = time.monotonic()
        with pytest.raises(kind, match=rf"pid {victim}\) stayed stopped .* for over {what}"):
            f(x, 10)
        assert time.monotonic() - start < 10
        assert not alive_after([victim], 5)  # SIGKILL ends a stopped process too
        same(f(x, 12), spin(x, 12))
    finally:
        for pid in f.pids:
            os.kill(pid, signal.SIGCONT)
        f.close()


def test_stopped_reads_the_process_state():
    from rollout._spawn import stopped

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not stopped(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not stopped(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stopped(proc.pid)
        os.kill(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 5
        while stopped(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not stopped(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert not stopped(proc.pid)  # gone: False, not an error


class _FakeWorker:
    """The parent side of a worker whose answers a thread scripts: (delay, message) pairs."""

    def __init__(self, script):
        self.conn, child = Pipe()
        self._child = child  # kept open: a closed end reads as a dead worker
        self.index, self.pid, self.programs = 0, os.getpid(), set()

        def play():
            for delay, msg in script:
                time.sleep(delay)
                child.send(msg)

        threading.Thread(target=play, daemon=True).start()

    def dead_message(self):
        return None

    def death(self):
        return "closed"


@pytest.mark.timeout(30)
def test_timeout_counts_from_start_of_execution_not_compile():
    from rollout._pool import ProcessPool, WorkerTimeout

    pool = ProcessPool(1)
    # 1.5 s of loading and compiling, then 0.3 s of execution: within timeout=1.
    w = _FakeWorker([(1.5, ("start", 0)), (0.3, ("ok", 0))])
    pool._collect({w.conn: w}, "key", timeout=1.0, call_id=0)
    # Execution that does not end: raised within a poll interval of the timeout.
    w = _FakeWorker([(1.0, ("start", 0))])
    t0 = time.monotonic()
    with pytest.raises(WorkerTimeout):
        pool._collect({w.conn: w}, "key", timeout=0.5, call_id=0)
    assert time.monotonic() - t0 < 1.0 + 0.5 + 1.0


INPROCESS_TIMEOUT = """
import threading, time, jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_num_cpu_devices", 2)
import rollout
def spin(x, n):
    body = lambda c: (c[0] * 1.0000001 + jnp.sin(c[0]) * 1e-7, c[1] + 1)
    return jax.lax.while_loop(lambda c: c[1] < n, body, (x, jnp.int32(0)))[0]
x = jnp.ones((4, 3))
t = time.monotonic(); jax.jit(spin)(x, 2**20).block_until_ready()
t = time.monotonic(); jax.jit(spin)(x, 2**20).block_until_ready(); per = time.monotonic() - t
n = int(min(2**31 - 1, 3.0 / max(per, 1e-6) * 2**20))  # about 3 s of work
f = rollout.on_cpu(spin, in_axes=(0, None), workers=2, executor="inprocess", timeout=1.0)
np.testing.assert_array_equal(f(x, 10), spin(x, 10))
t = time.monotonic()
try:
    f(x, n)
    raise SystemExit("no timeout")
except rollout.WorkerTimeout as e:
    print("timeout after %.2f s" % (time.monotonic() - t), flush=True)
deadline = time.monotonic() + 60  # the abandoned execution finishes in the background
while any(t.name == "on_cpu-inprocess" for t in threading.enumerate()):
    assert time.monotonic() < deadline
    time.sleep(0.1)
np.testing.assert_array_equal(f(x, 12), spin(x, 12))
np.testing.assert_array_equal(jax.jit(f)(x, 14), spin(x, 14))
print("usable", flush=True)
"""


@pytest.mark.timeout(120)
def test_inprocess_timeout_then_later_calls_work():
    res = subprocess.run(
        [sys.executable, "-c", INPROCESS_TIMEOUT],
        capture_output=True,
        text=True,
        timeout=110,
        env=ENV,
    )
    assert res.returncode == 0 and "usable" in res.stdout, res.stdout + res.stderr[-3000:]
    took = float(res.stdout.split("timeout after ")[1].split()[0])
    assert took < 3.0, res.stdout


INPROCESS_QUEUED = """
import threading, jax, numpy as np
jax.config.update("jax_num_cpu_devices", 2)
import rollout
gate = threading.Event()
def held(x):  # its execution ends when the gate opens
    wait = lambda x: (gate.wait(), x)[1]
    return jax.pure_callback(wait, jax.ShapeDtypeStruct(x.shape, x.dtype), x) * 2
f = rollout.on_cpu(held, workers=2, executor="inprocess", timeout=1.0)
g = rollout.on_cpu(lambda x: x * 3, workers=2, executor="inprocess", timeout=1.0)  # another
x = np.ones((4, 3), np.float32)
np.testing.assert_array_equal(g(x), x * 3)  # compiled before: the next call only queues
try:
    f(x)
    raise SystemExit("no timeout")
except rollout.WorkerTimeout:
    pass  # abandoned, still running
for wrapper in (f, g):  # another wrapper's call queues on the same CPU devices too
    try:
        wrapper(x + 1)
        raise SystemExit("ran behind the abandoned execution")
    except rollout.WorkerTimeout as e:
        assert "this call did not start" in str(e), e
threading.Timer(0.3, gate.set).start()  # the abandoned one ends 0.3 s into the next wait
np.testing.assert_array_equal(f(x + 2), (x + 2) * 2)
np.testing.assert_array_equal(g(x + 2), (x + 2) * 3)
print("ran", flush=True)
"""


@pytest.mark.timeout(120)
def test_inprocess_timeout_does_not_count_waiting_for_an_abandoned_execution():
    """A call after an inprocess timeout queues behind the abandoned execution, whichever
    wrapper makes it: it waits up to its own timeout for it, then gets its full timeout to run
    (another wrapper's call was timed from the start and blamed for the abandoned one's time)."""
    res = subprocess.run(
        [sys.executable, "-c", INPROCESS_QUEUED], capture_output=True, text=True, timeout=110,
        env=ENV,
    )  # fmt: skip
    assert res.returncode == 0 and "ran" in res.stdout, res.stdout + res.stderr[-3000:]


# ------------------------------------------------------------------------------ caches


@pytest.mark.timeout(180)
@pytest.mark.parametrize("executor", ["process", "inprocess"])
def test_compiled_shapes_are_bounded_and_evicted_shapes_still_work(executor):
    f = on_cpu(lambda x: jnp.tanh(x) * 2, workers=W, executor=executor, cache_size=3)
    try:
        for rows in [2, 4, 6, 8, 10, 2, 4, 12, 2]:  # 2 and 4 come back after eviction
            x = jnp.linspace(-1, 1, rows * 3).reshape(rows, 3)
            want = np.tanh(np.asarray(x)) * 2
            np.testing.assert_allclose(f(x), want, rtol=1e-6)
            np.testing.assert_allclose(jax.jit(f)(x), want, rtol=1e-6)
            if executor == "process":
                assert len(f._exports) <= 3
                pool = f._pool
                for w in pool._workers:  # what each worker holds, as the parent tracks it
                    assert len(w.programs - w.drops) <= 3
            else:
                assert len(f._inprocess._compiled) <= 3
    finally:
        f.close()


def test_lru_evicts_least_recently_used():
    from rollout._on_cpu import _LRU

    gone: list = []
    lru = _LRU(2, on_evict=gone.extend)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # a is now the most recent
    lru.put("c", 3)
    assert gone == ["b"] and lru.keys() == ["a", "c"] and lru.get("b") is None
    lru.clear()
    assert sorted(gone) == ["a", "b", "c"] and len(lru) == 0


WRAPPER_DROPPED = textwrap.dedent(
    """
    import gc, jax, jax.numpy as jnp
    from rollout import on_cpu
    from rollout._pool import shared_pool
    pool = shared_pool(2)
    held = lambda: [len(w.programs - w.drops) for w in pool._workers]  # as the parent tracks it
    for i in range(3):
        f = on_cpu(lambda x, i=i: x + i, workers=2, executor="process")
        f(jnp.ones((4, 2)))
        print(*held(), flush=True)  # the replaced wrapper's program is dropped
    del f
    gc.collect()
    print(*held(), flush=True)
    """
)


@pytest.mark.timeout(120)
def test_dropped_wrappers_release_their_worker_programs():
    """A garbage-collected wrapper tells the workers to drop its programs."""
    res = subprocess.run(
        [sys.executable, "-c", WRAPPER_DROPPED],
        capture_output=True,
        text=True,
        timeout=100,
        env=ENV,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split("\n")[:4] == ["1 1"] * 3 + ["0 0"], res.stdout


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.timeout(180)
def test_evicted_programs_free_worker_memory():
    """Each program embeds the 48 MB table fn closes over; JAX's own caches in the worker kept
    every evicted program alive (a table each per worker) until the worker emptied them.

    The table's size sets the leak (3 tables per worker) and the bound (2 tables) alike, and
    each call's cost (the constant serialised, sent and compiled in every worker). Above glibc's
    largest mmap threshold (32 MB) its buffers go back to the system when freed; a 24 MB table's
    could stay in a malloc arena: now and then a ~70 MB RSS step in a worker that frees well."""
    table = np.random.default_rng(0).normal(size=12_000_000).astype(np.float32)
    f = on_cpu(lambda i: jnp.asarray(table)[i], workers=W, executor="process", cache_size=1)
    try:
        rss = []
        for rows in range(2, 12, 2):  # a new batch shape each call evicts the previous program
            idx = np.arange(rows * 3, dtype=np.int32).reshape(rows, 3) * 1000
            same(f(idx), table[idx])
            rss.append(sum(map(_rss_mb, f.pids)))
        growth = rss[-1] - rss[1]  # over 3 evictions in each of the W workers (old: ~280 MB)
        assert growth < 2 * table.nbytes / 2**20, rss
    finally:
        f.close()


def test_an_output_shape_that_depends_on_the_batch_size_is_an_error_not_broadcast():
    outer = lambda x: x[:, None] * x[None, :]  # (B, B): not row-independent
    batch_last = lambda x: jnp.stack([x, 2 * x, 3 * x, 4 * x])  # (4, B), and B = 4 here
    for fn, x in ((outer, jnp.array([1.0, 2.0])), (batch_last, jnp.arange(4.0))):
        for executor in ("process", "inprocess"):
            f = on_cpu(fn, workers=W, executor=executor)
            with pytest.raises(Exception, match="fn must be row-independent") as info:
                f(x)
            assert "with the batch on axis 0 of every output" in str(info.value)
            f.close()


def test_an_output_dtype_that_depends_on_the_batch_size_is_an_error_not_cast():
    # The whole batch (4 rows) gives int32, each worker's chunk (2 rows) float32: NumPy would
    # truncate 1.6 to 1 where fn itself rounds it to 2.
    fn = lambda v: jnp.round(v).astype(jnp.int32) if v.shape[0] == 4 else v
    x = np.array([0.4, 1.6, 2.4, 3.6], np.float32)
    for executor in ("process", "inprocess"):
        f = on_cpu(fn, workers=2, executor=executor)
        for call in (f, jax.jit(f)):
            with pytest.raises(Exception, match="fn must be row-independent") as info:
                call(x)
            assert "float32" in str(info.value) and "int32" in str(info.value)
        f.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("executor", ["process", "inprocess"])
def test_a_changed_closed_over_value_compiles_anew_like_the_function_called_directly(executor):
    """A value fn closes over (one that sets the output's shape too), or that a callable
    object holds, is read anew by every eager call, as by fn itself: it compiled once and kept
    the first value before (the same batch, and a new batch whose chunks had the old size)."""
    cfg = {"reps": 2}
    f = on_cpu(lambda x: jnp.tile(x, cfg["reps"]), workers=W, executor=executor)
    g = on_cpu(Shift(np.ones(2, np.float32)), workers=W, executor=executor)
    try:
        x = np.arange(8, dtype=np.float32).reshape(4, 2)
        same(f(x), np.tile(x, 2))
        same(g(x), x + 1)
        cfg["reps"] = 3
        with pytest.warns(UserWarning, match=r"compiled anew: 'cfg.reps' \(read by"):
            same(f(x), np.tile(x, 3))
        same(f(x[:3]), np.tile(x[:3], 3))  # chunks of 2 rows again
        g.fn.w = np.full(2, 5, np.float32)
        with pytest.warns(UserWarning, match=r"compiled anew: 'self.w'"):
            same(g(x), x + 5)
    finally:
        f.close()
        g.close()


class Shift:
    def __init__(self, w):
        self.w = w

    def __call__(self, x):
        return x + self.w


EXIT_DURING_CALL = textwrap.dedent(
    """
    import threading, time
    import jax, jax.numpy as jnp
    import rollout

    def forever(x):  # never ends
        return jax.lax.while_loop(lambda c: c[0, 0] > -1.0, lambda c: c + 1e-7 * jnp.tanh(c), x)

    g = rollout.on_cpu(forever, workers=2)
    threading.Thread(target=lambda: g(jnp.ones((2, 4))), daemon=True).start()
    def pids():
        try:
            return g.pids
        except AttributeError:  # workers still starting
            return []

    deadline = time.monotonic() + 60
    while len(pids()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(3.0)  # the workers are in the call
    print(*pids(), flush=True)
    """
)


@pytest.mark.timeout(120)
def test_exit_with_a_call_running_in_a_daemon_thread_ends_its_workers():
    env = dict(ENV, JAX_NUM_CPU_DEVICES="2")
    res = subprocess.run(
        [sys.executable, "-c", EXIT_DURING_CALL], capture_output=True, text=True, timeout=100,
        env=env,
    )  # fmt: skip
    pids = [int(p) for p in res.stdout.split()]
    assert len(pids) == 2, res.stdout + res.stderr[-2000:]
    assert not alive_after(pids, 0.5)  # killed at exit, not left spinning as orphans


@pytest.mark.timeout(120)
def test_workers_in_a_call_end_soon_after_their_parent_is_sigkilled():
    # A SIGKILLed parent closes the workers' socket, but a worker in a call (here one that never
    # ends) does not read it: it notices that it was orphaned instead.
    env = dict(ENV, JAX_NUM_CPU_DEVICES="2")
    script = EXIT_DURING_CALL + "time.sleep(100)\n"
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=env)  # fmt: skip
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(map(alive, pids))
        parent.kill()
        parent.wait(10)
        assert not alive_after(pids, 5), "orphaned workers still running 5 s after their parent"
    finally:
        parent.kill()


def test_a_host_callback_inside_fn_is_one_clear_error_for_worker_processes():
    def noisy(x):
        jax.debug.print("x = {}", x)
        return x + 1

    f = on_cpu(noisy, workers=W, executor="process")
    with pytest.raises(ValueError, match=r"fn makes a host callback \(jax.debug.print"):
        f(jnp.ones((4, 2)))
    # Traced: refused while tracing (lower runs nothing), not inside the callback at run time,
    # also for inputs sharded over several devices.
    mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])
    sharded = jax.device_put(np.ones((4, 2), np.float32), NamedSharding(mesh, P("d")))
    for x in (jnp.ones((4, 2)), sharded):
        with pytest.raises(ValueError, match=r"fn makes a host callback \(jax.debug.print"):
            jax.jit(f).lower(x)
    f.close()


def test_numpy_on_fns_inputs_is_one_clear_error():
    f = on_cpu(lambda x: np.tanh(x) * 2, workers=W, executor="process")
    for call in (
        lambda: f(np.ones((4, 2), np.float32)),
        lambda: jax.jit(f).lower(jnp.ones((4, 2))),
    ):
        with pytest.raises(TypeError, match=r"fn must be written with jax\.numpy .* use jnp"):
            call()
    f.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", ["_worker.py", "hostenv/_worker.py"])
def test_a_worker_whose_parent_is_gone_exits_quietly(script):
    """A parent that stops right after starting its workers (a refused run) left each of them
    printing a BrokenPipeError traceback as it said it was ready."""
    import socket

    path = os.path.join(os.path.dirname(rollout.__file__), script)
    parent, child = socket.socketpair()
    proc = subprocess.Popen(
        [sys.executable, "-u", path, str(child.fileno())],
        pass_fds=(child.fileno(),), stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    child.close()
    parent.close()
    _, err = proc.communicate(timeout=100)
    assert proc.returncode == 0 and err == b"", err.decode()[-2000:]


@pytest.mark.timeout(120)
def test_a_timeout_in_a_step_whose_devices_pass_their_own_values_fails_once():
    """Each device passes its own shared value (a member's own parameter), so the 8 calls of
    one step cannot merge: after the first timed out, each of the others started a new pool
    and waited out its own timeout (8 devices: about 8x timeout= before the error)."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    f = on_cpu(lambda x, n, w: spin(x * w, n), in_axes=(0, None, None), workers=W, timeout=1)
    specs = dict(in_specs=(P("d"), P(), P("d")), out_specs=P("d"))
    per_device = jax.jit(jax.shard_map(lambda x, n, w: f(x, n, w[0]), mesh=mesh, **specs))
    x, w = jnp.ones((16, 3)), jnp.arange(1.0, 9.0)
    try:
        with rollout.worker_errors():
            same(per_device(x, 10, w), jnp.concatenate([spin(x[:2] * v, 10) for v in w]))
        start = time.monotonic()
        with pytest.raises(rollout.WorkerTimeout, match=r"did not finish within timeout=1 s"):
            with rollout.worker_errors():
                per_device(x, 2**31 - 1, w).block_until_ready()
        took = time.monotonic() - start
        assert took < 4.0, f"the error came {took:.1f} s after the call (timeout=1 s)"
        with rollout.worker_errors():  # the next step works
            same(per_device(x, 10, w), jnp.concatenate([spin(x[:2] * v, 10) for v in w]))
    finally:
        f.close()


@pytest.mark.timeout(120)
def test_a_timeout_fails_only_its_own_programs_calls():
    """The failed step's other device calls fail with it (above), but a call of another program
    using the same wrapper, queued behind it in another thread, still runs: the first version
    failed it with the other program's timeout, naming that program's worker."""
    f = on_cpu(spin, in_axes=(0, None), workers=W, timeout=1)
    slow, fast = jax.jit(lambda x: f(x, 2**31 - 1) + 1), jax.jit(lambda x: f(x, 10) * 2)
    x, results = jnp.ones((4, 3)), {}
    same(fast(x), spin(x, 10) * 2)  # compiled and exported

    def run(name, g, delay):
        time.sleep(delay)
        try:
            with rollout.worker_errors():
                results[name] = jax.block_until_ready(g(x))
        except rollout.WorkerError as e:
            results[name] = e

    threads = [
        threading.Thread(target=run, args=a) for a in (("slow", slow, 0), ("fast", fast, 0.3))
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert isinstance(results["slow"], rollout.WorkerTimeout), results["slow"]
        same(results["fast"], spin(x, 10) * 2)
    finally:
        f.close()


STUCK_PART = """
import sys, time, jax, jax.numpy as jnp
jax.config.update("jax_num_cpu_devices", 2)
from jax.sharding import AxisType, PartitionSpec as P
from ensemble._exit import device_work_left_running, exit_process
from rollout._relay import wait_for_outputs
def host(i):
    if int(i[0]) == 1:
        raise RuntimeError("device 1's part failed")
    return i
def part(i):
    i = jax.pure_callback(host, jax.ShapeDtypeStruct(i.shape, i.dtype), i)
    return jax.lax.psum(i, "d")  # device 0 waits here for device 1, which never comes
mesh = jax.make_mesh((2,), ("d",), axis_types=(AxisType.Auto,))
out = jax.jit(jax.shard_map(part, mesh=mesh, in_specs=P("d"), out_specs=P()))(jnp.arange(2))
ok = jax.numpy.ones(3) * 2  # a call that ends: waited for whole
assert wait_for_outputs(ok) == (True, None) and float(ok[0]) == 2.0
t = time.monotonic()  # (read in order, device 0's part waited until XLA aborted the process)
ended, error = wait_for_outputs(out, after_failure=0.5)
assert not ended and "device 1's part failed" in str(error), error
print("gave up after %.1f s" % (time.monotonic() - t), flush=True)
if sys.argv[1] == "marked":
    device_work_left_running()
exit_process(1)
"""


@pytest.mark.timeout(150)
def test_a_failed_process_with_a_device_stuck_in_a_collective_exits_with_its_code():
    """One device's callback failed and the other waited in a psum for it: reading the outputs
    in order waited on that one until XLA aborted the process (exit 134, no error line), and
    after the error line, exiting waited for that abort too. The failed part's error comes
    within the wait given, and the process then ends with its own code."""
    res = subprocess.run([sys.executable, "-c", STUCK_PART, "marked"], capture_output=True,
                         text=True, timeout=140, env=ENV)  # fmt: skip
    assert res.returncode == 1, res.stderr[-3000:]
    assert float(res.stdout.split("gave up after ")[1].split()[0]) < 5.0
    assert "Termination timeout" not in res.stderr


@pytest.mark.timeout(120)
def test_a_failed_call_over_several_devices_keeps_none_of_the_callers_arrays_alive():
    """Each device's failed callback recorded the error, and one record was forgotten: the
    other, the very error raised again, then held the caller's frames (a train step's whole
    state) after the caller had let it go. Without worker_errors, the records held the
    callback's frames, hence its arguments."""
    import gc

    f = on_cpu(spin, in_axes=(0, None), workers=W, timeout=0.3)
    mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])
    step = jax.jit(lambda x: f(x, 2**31 - 1) * 2)

    def attempt(relay: bool) -> str:
        held = jnp.ones(1000) + 1  # the caller's, alive only in this frame
        x = jax.device_put(jnp.ones((4, 3)), NamedSharding(mesh, P("d")))
        try:
            with rollout.worker_errors() if relay else contextlib.nullcontext():
                jax.block_until_ready(step(x) + held[0])
        except Exception as e:
            return type(e).__name__

    logging.disable(logging.ERROR)  # pytest keeps JAX's record of each, with its traceback
    try:
        for relay, raised in ((True, "WorkerTimeout"), (False, "JaxRuntimeError")):
            gc.collect()
            before = len(jax.live_arrays())
            assert [attempt(relay) for _ in range(3)] == [raised] * 3
            gc.collect()
            assert len(jax.live_arrays()) == before, jax.live_arrays()
    finally:
        logging.disable(logging.NOTSET)
        f.close()
