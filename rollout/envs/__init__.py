"""Functional environments in pure JAX: jit/vmap/scan friendly, no Python state.

Every env is a frozen (hashable) dataclass of static configuration with pure methods:

- `env.reset(key, params=None) -> (state, obs)`
- `env.step(state, action, key, params=None) -> (state, obs, reward, terminated, truncated, info)`
- `env.observation_space` (a `Box`: `shape`, `dtype`, `low`, `high`), `env.action_space` (a
  `Discrete` with `num_actions`, a `MultiDiscrete` with `nvec`, or a `Box` with `shape`, `low`,
  `high`), `env.max_episode_steps`.

`state` is a NamedTuple pytree that includes the step counter `t` (truncation at the time
limit). `params` is the env's array input that may change every step (the audio env's
synthesiser weights); `None` means `env.default_params()`; CartPole and Pendulum ignore it.
Batch with `jax.vmap` (`in_axes=(0, 0, 0, None)` shares `params` across envs).

Environments (`make(name)`): 'cartpole' / 'CartPole-v1' and 'pendulum' / 'Pendulum-v1'
(ports of gymnasium's, tested step by step against it), and 'audio' (`AudioSynth`: audio frames
made sample by sample by a GRU synthesiser whose weights, `SynthParams` from
`init_synth_params`, are the `params` input of every step).

Other libraries' envs by prefix: 'gymnax:<name>' (a pure-JAX `GymnaxEnv` on this API),
'gymnasium:<id>' and 'envpool:<task>' (a `rollout.hostenv.HostEnv`: envs stepped in CPU worker
processes, or with `workers_per_device=0` in this process; bound to a learner's members with
`HostEnv.bind`).

`make(name)` wraps the env in `AutoReset` by default: finished episodes restart inside `step`
and `info` carries `final_obs` (the true last observation), `done`, `episode_return` and
`episode_length`.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from rollout import envs
  >>> env = envs.make("CartPole-v1")
  >>> keys = jax.random.split(jax.random.key(0), 64)
  >>> state, obs = jax.vmap(env.reset)(keys)
  >>> obs.shape, env.action_space.num_actions
  ((64, 4), 2)
  >>> step = jax.jit(jax.vmap(env.step))
  >>> state, obs, reward, terminated, truncated, info = step(
  ...     state, jnp.zeros(64, jnp.int32), keys)
  >>> sorted(info)
  ['done', 'episode_length', 'episode_return', 'final_obs']

The audio env, with synthesiser weights that the caller owns and may change every step:
  >>> audio = envs.make("audio", light=True)
  >>> synth = envs.init_synth_params(jax.random.key(1), audio.unwrapped.hidden_size)
  >>> state, obs = jax.vmap(audio.reset, in_axes=(0, None))(keys, synth)
  >>> step = jax.jit(jax.vmap(audio.step, in_axes=(0, 0, 0, None)))
  >>> state, obs, reward, *_ = step(state, jnp.full(64, 2), keys, synth)
  >>> obs.shape, reward.shape
  ((64, 33), (64,))
"""

from __future__ import annotations

import numbers
from typing import Any

from rollout.envs._audio import (
    AudioState,
    AudioSynth,
    SynthParams,
    init_synth_params,
    synthesize,
)
from rollout.envs._cartpole import CartPole, CartPoleState
from rollout.envs._core import (
    AutoReset,
    AutoResetState,
    Box,
    Discrete,
    Env,
    MultiDiscrete,
    Space,
    valid_discrete_action,
)
from rollout.envs._pendulum import Pendulum, PendulumState

_REGISTRY: dict[str, type[Env]] = {
    "cartpole": CartPole,
    "cartpole-v1": CartPole,
    "pendulum": Pendulum,
    "pendulum-v1": Pendulum,
    "audio": AudioSynth,
}

#: Names accepted by `make` (case-insensitive).
ENV_NAMES: tuple[str, ...] = ("cartpole", "CartPole-v1", "pendulum", "Pendulum-v1", "audio")

#: Prefixes of ids from other libraries: `gymnasium:<id>`, `envpool:<task>`, `gymnax:<name>`,
#: `brax:<name>`.
ENV_PREFIXES: tuple[str, ...] = ("gymnasium:", "envpool:", "gymnax:", "brax:")

#: The prefixes whose envs run on the host (`HostEnv` workers); the others are pure JAX.
HOST_PREFIXES: tuple[str, ...] = ("gymnasium:", "envpool:")

#: `make` kwargs of host envs that configure `HostEnv` (its workers), not the env itself.
HOST_ENV_KWARGS: tuple[str, ...] = ("workers_per_device", "timeout")


def make(name: str, *, auto_reset: bool = True, **kwargs: Any) -> Any:
    """Build an environment by name.

    Args:
      name: one of `ENV_NAMES` (case-insensitive), or an id of another library:
        - `'gymnasium:<id>'` (any registered id, e.g. `'gymnasium:HalfCheetah-v5'`, or
          `'gymnasium:my_module:MyEnv-v0'`, which imports `my_module` first): a `HostEnv`,
          stepped in CPU worker processes (see `rollout.hostenv`); `kwargs` go to
          `gymnasium.make`, except `workers_per_device` and `timeout`, which go to `HostEnv`.
        - `'envpool:<task>'` (e.g. `'envpool:HalfCheetah-v5'`): a `HostEnv`, one EnvPool pool
          per device stepped from its callback (or one per worker with `workers_per_device`);
          `kwargs` go to `envpool.make`.
        - `'gymnax:<name>'` (e.g. `'gymnax:Acrobot-v1'`): a functional env (`GymnaxEnv`, in
          `AutoReset` unless `auto_reset=False`); `kwargs` go to `gymnax.make`.
        - `'brax:<name>'` (e.g. `'brax:ant'`): a functional env (`BraxEnv`, in `AutoReset`
          unless `auto_reset=False`); `kwargs` go to `brax.envs.get_environment` (e.g.
          `backend='spring'`), except `episode_length` (the time limit, default 1000).
      auto_reset: wrap in `AutoReset` (default) so episodes restart inside `step` and `info`
        reports the true final observation and episode statistics; False gives the bare env.
        (Host envs always reset finished episodes in the same step.)
      **kwargs: fields of the env's dataclass (e.g. `max_episode_steps=100`, `g=9.81`); for
        'audio' also `light=True` (`AudioSynth.light()`, a small configuration for tests).

    Raises:
      ValueError: unknown name (the message lists the valid ones), an id the other library does
        not know, or that library not installed (the message says which extra to install).

    Example:
      >>> env = make("Pendulum-v1", max_episode_steps=50)
      >>> type(env).__name__, env.max_episode_steps, env.action_space.shape
      ('AutoReset', 50, (1,))
      >>> type(make("cartpole", auto_reset=False)).__name__
      'CartPole'
    """
    prefix, sep, rest = str(name).partition(":")
    if sep and f"{prefix}:" in HOST_PREFIXES:
        from rollout.hostenv import HostEnv

        host = {k: kwargs.pop(k) for k in HOST_ENV_KWARGS if k in kwargs}
        return HostEnv(prefix, rest, kwargs, **host)
    if sep and prefix in ("gymnax", "brax"):
        if prefix == "gymnax":
            from rollout.envs._gymnax import GymnaxEnv as Adapter
        else:
            from rollout.envs._brax import BraxEnv as Adapter
        env = Adapter(rest, tuple(sorted(kwargs.items())))
        return AutoReset(env) if auto_reset else env
    cls = _REGISTRY.get(str(name).lower())
    if cls is None:
        raise ValueError(
            f"unknown env {name!r}; valid names: {', '.join(ENV_NAMES)}, or an id with a prefix "
            f"{', '.join(ENV_PREFIXES)} (e.g. 'gymnasium:HalfCheetah-v5', 'gymnax:Acrobot-v1')"
        )
    if cls is AudioSynth and kwargs.pop("light", False):
        env: Env = AudioSynth.light(**kwargs)
    else:
        env = cls(**kwargs)
    limit = env.max_episode_steps
    if isinstance(limit, bool) or not isinstance(limit, numbers.Integral) or limit < 1:
        raise ValueError(f"{name}: max_episode_steps must be a positive int, got {limit!r}.")
    return AutoReset(env) if auto_reset else env


__all__ = [
    "ENV_NAMES",
    "ENV_PREFIXES",
    "HOST_ENV_KWARGS",
    "HOST_PREFIXES",
    "AudioState",
    "AudioSynth",
    "AutoReset",
    "AutoResetState",
    "Box",
    "CartPole",
    "CartPoleState",
    "Discrete",
    "Env",
    "MultiDiscrete",
    "Pendulum",
    "PendulumState",
    "Space",
    "SynthParams",
    "init_synth_params",
    "make",
    "synthesize",
    "valid_discrete_action",
]
