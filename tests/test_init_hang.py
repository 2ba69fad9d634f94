"""Regression: orthogonal init with 2 members per device on 2 CPU devices used to hang forever.

Root cause (jax/jaxlib 0.10.2, CPU): a multi-device program in which every device runs a
*batched* LAPACK custom call (QR here, also SVD, eigh, LU) next to threefry's RNG loops never
completes: both device threads wait in ``CpuPjRtRawLoadedExecutable::Execute`` while every XLA
worker thread is idle. ``vmap`` over 2 members per device batches the QR of
``nn.initializers.orthogonal``; one member per device (batch 1) does not hang. The hang is there
with and without ``--xla_cpu_multi_thread_eigen=false`` and with
``OPENBLAS_NUM_THREADS=1``. The init now maps the members of a device one after another
(``ensemble._mesh.vmap_members``).

Each case runs in its own process (2 CPU devices, its own XLA_FLAGS) under a hard timeout, so a
regression fails the test instead of hanging the suite.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from subprocess_env import clean_env

from rollout._devices import THREAD_FLAG

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """
import jax
import jax.numpy as jnp
import numpy as np
assert len(jax.devices()) == 2, jax.devices()
import ensemble
N = 4  # 2 members per device
"""

LINEN = """
import flax.linen as nn

class ActorCritic(nn.Module):  # the PPO engineer's 64-64 tanh MLP, flax's orthogonal init
    @nn.compact
    def __call__(self, x):
        orth = nn.initializers.orthogonal
        for _ in range(2):
            x = nn.tanh(nn.Dense(64, kernel_init=orth(np.sqrt(2)))(x))
        return nn.Dense(1, kernel_init=orth(1.0))(x)

model = ActorCritic()
x = jnp.zeros((1, 4))
ens = ensemble.build(model, N)
variables = ens.init(jax.random.key(0), x)
jax.block_until_ready(variables)
keys = jax.random.split(jax.random.key(0), N)
init = jax.jit(model.init)  # one program for every reference member, not one per op
for i in range(N):
    plain = init(keys[i], x)
    got = ens.member(variables, i)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(plain), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
kernel = variables["params"]["Dense_1"]["kernel"]
assert {s.data.shape for s in kernel.addressable_shards} == {(2, 64, 64)}
w = np.asarray(kernel)
assert np.allclose(np.einsum("nij,nik->njk", w, w), 2.0 * np.eye(64), atol=1e-4)
print("OK")
"""

NNX = """
from flax import nnx

def factory(rngs):
    orth = nnx.initializers.orthogonal()
    return nnx.Sequential(
        nnx.Linear(4, 64, kernel_init=orth, rngs=rngs),
        nnx.Linear(64, 64, kernel_init=orth, rngs=rngs),
    )

ens = ensemble.build(factory, N, rngs=0)
jax.block_until_ready(nnx.state(ens))
keys = jax.random.split(jax.random.key(0), N)
init = jax.jit(lambda k: nnx.state(factory(nnx.Rngs(default=k)), nnx.Param))
for i in range(N):
    plain = init(keys[i])
    got = nnx.state(ens.member(i), nnx.Param)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(plain), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
kernel = ens.members.layers[1].kernel[...]
assert {s.data.shape for s in kernel.addressable_shards} == {(2, 64, 64)}
print("OK")
"""


def _run(code: str, xla_flags: str, timeout: float = 90) -> subprocess.CompletedProcess:
    env = clean_env(JAX_NUM_CPU_DEVICES="2", JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags)
    script = textwrap.dedent(PRELUDE) + textwrap.dedent(code)
    try:
        return subprocess.run(
            [sys.executable, "-c", script],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"init hung: no result after {timeout}s with 2 members per device on 2 CPU "
            f"devices (XLA_FLAGS={xla_flags!r})"
        )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("xla_flags", ["", THREAD_FLAG], ids=["default-flags", "thread-flags"])
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_orthogonal_init_two_members_per_device_finishes(api, xla_flags):
    proc = _run(LINEN if api == "linen" else NNX, xla_flags)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("OK"), proc.stdout[-2000:]
