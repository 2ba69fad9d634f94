"""8 simulated CPU devices for every test and docstring example, set before anything touches a
JAX backend."""

import atexit
import os
import shutil
import tempfile

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

import jax

jax.config.update("jax_num_cpu_devices", 8)

NUM_DEVICES = 8
