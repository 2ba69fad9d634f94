"""CartPole-v1 in pure JAX, a port of gymnasium's `classic_control/cartpole.py` (float32)."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rollout.envs._core import (
    Array,
    Box,
    Discrete,
    Env,
    Info,
    PRNGKey,
    PyTree,
    valid_discrete_action,
)


class CartPoleState(NamedTuple):
    """Cart position and velocity, pole angle and angular velocity, and the step counter.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> state, obs = CartPole().reset(jax.random.key(0))
      >>> bool((obs == jnp.stack(state[:4])).all()), int(state.t)  # the observation is the state
      (True, 0)
    """

    x: Array
    x_dot: Array
    theta: Array
    theta_dot: Array
    t: Array  # int32 steps taken in this episode


@dataclasses.dataclass(frozen=True)
class CartPole(Env):
    """CartPole-v1: keep the pole upright by pushing the cart left (0) or right (1).

    Same dynamics (Euler integration, tau 0.02), thresholds (|x| > 2.4, |theta| > 12 degrees),
    reward (+1 every step, the terminating one included; `sutton_barto_reward`: 0, and -1 on
    termination), initial state (each of the 4 variables uniform in [-0.05, 0.05]) and time limit
    (truncated when `t >= max_episode_steps`, 500) as gymnasium's CartPole-v1 with its TimeLimit.
    Stepping an already terminated episode is undefined, as in gymnasium: use `AutoReset`.
    An action other than 0 or 1 is a `ValueError` when concrete (gymnasium asserts it); under
    `jit` it cannot raise, so it makes the state, observation and reward NaN instead of a number.

    Example:
      >>> import jax
      >>> env = CartPole()
      >>> state, obs = env.reset(jax.random.key(0))
      >>> state, obs, reward, terminated, truncated, _ = env.step(state, 1, jax.random.key(1))
      >>> obs.shape, float(reward), bool(state.x_dot > 0)  # pushed right: the cart moves right
      ((4,), 1.0, True)
    """

    gravity: float = 9.8
    masscart: float = 1.0
    masspole: float = 0.1
    length: float = 0.5  # half the pole's length
    force_mag: float = 10.0
    tau: float = 0.02
    kinematics_integrator: str = "euler"  # or "semi-implicit euler"
    theta_threshold_radians: float = 12 * 2 * math.pi / 360
    x_threshold: float = 2.4
    reset_low: float = -0.05
    reset_high: float = 0.05
    max_episode_steps: int = 500
    sutton_barto_reward: bool = False
    name: str = "CartPole-v1"

    @property
    def observation_space(self) -> Box:
        """`[x, x_dot, theta, theta_dot]`: twice the termination thresholds, speeds unbounded."""
        high = (self.x_threshold * 2, math.inf, self.theta_threshold_radians * 2, math.inf)
        return Box((4,), tuple(-h for h in high), high)

    @property
    def action_space(self) -> Discrete:
        """Two actions: push the cart left (0) or right (1)."""
        return Discrete(2)

    def observation(self, state: CartPoleState) -> Array:
        """The float32 observation `[x, x_dot, theta, theta_dot]` of a state."""
        return jnp.stack([state.x, state.x_dot, state.theta, state.theta_dot]).astype(jnp.float32)

    def reset(self, key: PRNGKey, params: PyTree = None) -> tuple[CartPoleState, Array]:
        """A new episode: each state variable uniform in `[reset_low, reset_high]`, `t = 0`."""
        del params
        values = jax.random.uniform(key, (4,), jnp.float32, self.reset_low, self.reset_high)
        state = CartPoleState(values[0], values[1], values[2], values[3], jnp.int32(0))
        return state, self.observation(state)

    def step(
        self, state: CartPoleState, action: Array, key: PRNGKey, params: PyTree = None
    ) -> tuple[CartPoleState, Array, Array, Array, Array, Info]:
        """One Euler step of the dynamics: `(state, obs, reward, terminated, truncated, {})`.

        Deterministic: `key` and `params` are unused.
        """
        del key, params
        valid = valid_discrete_action(action, 2, self.name)
        x, x_dot, theta, theta_dot = (
            jnp.where(valid, jnp.asarray(v, jnp.float32), jnp.nan) for v in state[:4]
        )
        total_mass = self.masspole + self.masscart
        polemass_length = self.masspole * self.length
        force = jnp.where(jnp.asarray(action) == 1, self.force_mag, -self.force_mag)
        costheta = jnp.cos(theta)
        sintheta = jnp.sin(theta)
        temp = (force + polemass_length * jnp.square(theta_dot) * sintheta) / total_mass
        thetaacc = (self.gravity * sintheta - costheta * temp) / (
            self.length * (4.0 / 3.0 - self.masspole * jnp.square(costheta) / total_mass)
        )
        xacc = temp - polemass_length * thetaacc * costheta / total_mass
        if self.kinematics_integrator == "euler":
            x = x + self.tau * x_dot
            x_dot = x_dot + self.tau * xacc
            theta = theta + self.tau * theta_dot
            theta_dot = theta_dot + self.tau * thetaacc
        else:  # semi-implicit euler
            x_dot = x_dot + self.tau * xacc
            x = x + self.tau * x_dot
            theta_dot = theta_dot + self.tau * thetaacc
            theta = theta + self.tau * theta_dot
        t = jnp.asarray(state.t, jnp.int32) + 1
        new_state = CartPoleState(x, x_dot, theta, theta_dot, t)
        terminated = (
            (x < -self.x_threshold)
            | (x > self.x_threshold)
            | (theta < -self.theta_threshold_radians)
            | (theta > self.theta_threshold_radians)
        )
        if self.sutton_barto_reward:
            reward = jnp.where(terminated, -1.0, 0.0).astype(jnp.float32)
        else:
            reward = jnp.ones((), jnp.float32)
        reward = jnp.where(valid, reward, jnp.nan)
        truncated = t >= self.max_episode_steps
        return new_state, self.observation(new_state), reward, terminated, truncated, {}
