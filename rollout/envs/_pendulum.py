"""Pendulum-v1 in pure JAX, a port of gymnasium's `classic_control/pendulum.py` (float32)."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rollout.envs._core import Array, Box, Env, Info, PRNGKey, PyTree


class PendulumState(NamedTuple):
    """Pendulum angle (in [-pi, pi), 0 = upright), angular velocity, and the step counter.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> state, obs = Pendulum().reset(jax.random.key(0))
      >>> bool(jnp.allclose(obs, jnp.stack([jnp.cos(state.theta), jnp.sin(state.theta),
      ...                                   state.theta_dot])))
      True
    """

    theta: Array
    theta_dot: Array
    t: Array  # int32 steps taken in this episode


def angle_normalize(x: Array) -> Array:
    """Angle to [-pi, pi), as gymnasium's `angle_normalize`."""
    return ((x + jnp.pi) % (2 * jnp.pi)) - jnp.pi


@dataclasses.dataclass(frozen=True)
class Pendulum(Env):
    """Pendulum-v1: swing the pendulum up and keep it upright with a torque in [-2, 2].

    Action: float32 of shape (1,), clipped to [-max_torque, max_torque]. Observation:
    `[cos(theta), sin(theta), theta_dot]`. Reward: `-(angle_normalize(theta)^2 + 0.1 theta_dot^2
    + 0.001 u^2)`. Never terminates; truncated when `t >= max_episode_steps` (200). Initial
    state: theta uniform in [-pi, pi], theta_dot uniform in [-1, 1]. As gymnasium's Pendulum-v1,
    except that the state keeps theta normalised to [-pi, pi) (float32 precision), which leaves
    observations and rewards unchanged.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> env = Pendulum()
      >>> state, obs = env.reset(jax.random.key(0))
      >>> state, obs, reward, terminated, _, _ = env.step(state, jnp.ones(1), jax.random.key(1))
      >>> obs.shape, bool(reward <= 0), bool(terminated)  # a cost; episodes only truncate
      ((3,), True, False)
    """

    max_speed: float = 8.0
    max_torque: float = 2.0
    dt: float = 0.05
    g: float = 10.0
    m: float = 1.0
    l: float = 1.0  # noqa: E741 (gymnasium's name)
    x_init: float = math.pi
    y_init: float = 1.0
    max_episode_steps: int = 200
    name: str = "Pendulum-v1"

    @property
    def observation_space(self) -> Box:
        """`[cos(theta), sin(theta), theta_dot]`, the speed bounded by `max_speed`."""
        high = (1.0, 1.0, self.max_speed)
        return Box((3,), tuple(-h for h in high), high)

    @property
    def action_space(self) -> Box:
        """The torque, shape (1,), in `[-max_torque, max_torque]`."""
        return Box.uniform((1,), -self.max_torque, self.max_torque)

    def observation(self, state: PendulumState) -> Array:
        """The float32 observation `[cos(theta), sin(theta), theta_dot]` of a state."""
        theta = jnp.asarray(state.theta, jnp.float32)
        return jnp.stack([jnp.cos(theta), jnp.sin(theta), state.theta_dot]).astype(jnp.float32)

    def reset(self, key: PRNGKey, params: PyTree = None) -> tuple[PendulumState, Array]:
        """A new episode: theta uniform in `[-x_init, x_init]`, theta_dot in `[-y_init, y_init]`."""
        del params
        high = jnp.array([self.x_init, self.y_init], jnp.float32)
        values = jax.random.uniform(key, (2,), jnp.float32, -high, high)
        state = PendulumState(values[0], values[1], jnp.int32(0))
        return state, self.observation(state)

    def step(
        self, state: PendulumState, action: Array, key: PRNGKey, params: PyTree = None
    ) -> tuple[PendulumState, Array, Array, Array, Array, Info]:
        """One step with the torque clipped: `(state, obs, reward, terminated, truncated, {})`.

        Deterministic: `key` and `params` are unused; `terminated` is always False.
        """
        del key, params
        th = jnp.asarray(state.theta, jnp.float32)
        thdot = jnp.asarray(state.theta_dot, jnp.float32)
        u = jnp.asarray(action, jnp.float32).reshape(())
        u = jnp.clip(u, -self.max_torque, self.max_torque)
        costs = angle_normalize(th) ** 2 + 0.1 * thdot**2 + 0.001 * (u**2)
        newthdot = (
            thdot
            + (3 * self.g / (2 * self.l) * jnp.sin(th) + 3.0 / (self.m * self.l**2) * u) * self.dt
        )
        newthdot = jnp.clip(newthdot, -self.max_speed, self.max_speed)
        # Kept in [-pi, pi): float32 loses precision on a growing angle (gymnasium's float64
        # state grows unbounded); observations and rewards only see it through sin/cos/normalise.
        newth = angle_normalize(th + newthdot * self.dt)
        t = jnp.asarray(state.t, jnp.int32) + 1
        new_state = PendulumState(newth, newthdot, t)
        reward = (-costs).astype(jnp.float32)
        terminated = jnp.zeros((), jnp.bool_)
        truncated = t >= self.max_episode_steps
        return new_state, self.observation(new_state), reward, terminated, truncated, {}
