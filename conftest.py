"""8 simulated CPU devices for every test and docstring example, set before anything touches a
JAX backend."""

import os

# One thread per simulated device keeps 8 devices on 2 cores from oversubscribing.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)

import jax

jax.config.update("jax_num_cpu_devices", 8)

NUM_DEVICES = 8
