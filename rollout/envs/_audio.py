"""An audio environment: frames synthesised sample by sample by a GRU whose weights are
an input of every step (a non-static rollout model).

Design: the synthesiser's weights are the env's `params` argument,
`step(state, action, key, params)`, never part of the static config (they change while the
environment runs, e.g. trained or annealed by the learner) nor of the per-env state (so a batch
of envs shares one copy: `jax.vmap(env.step, in_axes=(0, 0, 0, None))`, and `rollout.on_cpu`
ships them once to every worker). `step` is a pure function of arrays (state, action, key,
params), so it jits, vmaps and exports with `jax.export`.

The task: each episode draws a tone (frequency) and a target loudness. Every step the agent turns
the excitation gain down / keeps it / turns it up (discrete, 3 actions; or a continuous change in
[-1, 1] with `discrete=False`); the GRU turns `gain * sin(phase)` into `samples_per_step` audio
samples, one `lax.scan` step per sample; the reward is `-|level - target|`, where level is the
frame's RMS around its mean. Since the level a gain gives depends on the synthesiser's weights,
the agent has to keep listening when the weights change. The observation is the audio frame
followed by the target: shape `(samples_per_step + 1,)`. The reset observation's frame is
silence. Episodes never terminate; they are truncated after `max_episode_steps`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rollout.envs._core import (
    Array,
    Box,
    Discrete,
    Env,
    Info,
    PRNGKey,
    Space,
    valid_discrete_action,
)


class SynthParams(NamedTuple):
    """Weights of the GRU synthesiser (hidden size H, one scalar input per sample).

    Gates follow the usual GRU (as `flax.linen.GRUCell`): r, z and the candidate n stacked on the
    last axis of `w_in` / `w_h` / `b` (3H), the candidate's hidden-side bias `b_hn` inside the
    reset gate, and a tanh readout `tanh(h @ w_out + b_out)`.

    Example:
      >>> import jax
      >>> params = init_synth_params(jax.random.key(0), hidden_size=8)
      >>> params.w_in.shape, params.w_h.shape, params.w_out.shape  # 3H: the r, z, n gates
      ((24,), (8, 24), (8,))
    """

    w_in: Array  # (3H,) input kernel
    w_h: Array  # (H, 3H) recurrent kernel
    b: Array  # (3H,) input-side biases
    b_hn: Array  # (H,) hidden-side bias of the candidate
    w_out: Array  # (H,) readout
    b_out: Array  # () readout bias


class AudioState(NamedTuple):
    """GRU hidden state, oscillator phase and frequency, gain, target level, step counter.

    Example:
      >>> import jax
      >>> env = AudioSynth.light()
      >>> state, obs = env.reset(jax.random.key(0))
      >>> state.h.shape, bool(obs[-1] == state.target)  # the target ends every observation
      ((8,), True)
    """

    h: Array  # (H,) float32
    phase: Array  # () radians in [0, 2 pi)
    freq: Array  # () Hz, drawn per episode
    gain: Array  # () excitation amplitude in [0, max_gain], the agent's control
    target: Array  # () target level, drawn per episode
    t: Array  # () int32 steps taken in this episode


def init_synth_params(
    key: PRNGKey,
    hidden_size: int = 32,
    *,
    input_scale: float = 0.5,
    recurrent_scale: float = 1.0,
    dtype: Any = jnp.float32,
) -> SynthParams:
    """Random synthesiser weights: normal input/readout kernels, a scaled normal recurrent one.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> params = init_synth_params(jax.random.key(0), 16, dtype=jnp.bfloat16)
      >>> params.w_h.shape, params.w_h.dtype
      ((16, 48), dtype(bfloat16))
    """
    k_in, k_h, k_out = jax.random.split(key, 3)
    h = hidden_size
    return SynthParams(
        w_in=input_scale * jax.random.normal(k_in, (3 * h,), dtype),
        w_h=recurrent_scale / math.sqrt(h) * jax.random.normal(k_h, (h, 3 * h), dtype),
        b=jnp.zeros((3 * h,), dtype),
        b_hn=jnp.zeros((h,), dtype),
        w_out=2.0 / math.sqrt(h) * jax.random.normal(k_out, (h,), dtype),
        b_out=jnp.zeros((), dtype),
    )


def synthesize(params: SynthParams, h: Array, excitation: Array) -> tuple[Array, Array]:
    """Runs the GRU over `excitation` (shape (T,)), one sample at a time (`lax.scan`).

    Returns the last hidden state (H,) and the audio (T,), each sample `tanh(h_t @ w_out + b_out)`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> params = init_synth_params(jax.random.key(0), 8)
      >>> h, audio = synthesize(params, jnp.zeros(8), jnp.sin(jnp.arange(64) / 4))
      >>> h.shape, audio.shape, bool((jnp.abs(audio) < 1).all())  # tanh readout
      ((8,), (64,), True)
    """
    hidden = h.shape[-1]
    # The input projections of all samples at once; the scan carries only the recurrence.
    x_proj = jnp.outer(excitation, params.w_in) + params.b[None]  # (T, 3H)

    def cell(h, xp):
        hp = h @ params.w_h  # (3H,)
        r = jax.nn.sigmoid(xp[:hidden] + hp[:hidden])
        z = jax.nn.sigmoid(xp[hidden : 2 * hidden] + hp[hidden : 2 * hidden])
        n = jnp.tanh(xp[2 * hidden :] + r * (hp[2 * hidden :] + params.b_hn))
        h = (1.0 - z) * n + z * h
        return h, jnp.tanh(h @ params.w_out + params.b_out)

    return jax.lax.scan(cell, h, x_proj)


@dataclasses.dataclass(frozen=True)
class AudioSynth(Env):
    """Match a target loudness by steering the excitation gain of a GRU synthesiser.

    See the module docstring. `params` (a `SynthParams`, see `init_synth_params`) is an input of
    `reset` and `step`; `None` uses `default_params()` (fixed weights from `params_seed`).
    `AudioSynth.light()` is a small configuration for tests.

    Example:
      >>> import jax
      >>> env = AudioSynth.light()
      >>> state, obs = env.reset(jax.random.key(0))
      >>> step, key = jax.jit(env.step), jax.random.key(1)
      >>> _, obs, reward, *_ = step(state, 2, key)  # gain up, default weights
      >>> other = init_synth_params(jax.random.key(2), env.hidden_size)
      >>> obs.shape, bool(step(state, 2, key, other)[2] != reward)  # other weights, other sound
      ((33,), True)
    """

    hidden_size: int = 32
    samples_per_step: int = 512
    sample_rate: float = 16000.0
    f_min: float = 110.0
    f_max: float = 880.0
    max_gain: float = 2.0
    gain_step: float = 0.1
    target_low: float = 0.05
    target_high: float = 0.4
    discrete: bool = True
    max_episode_steps: int = 200
    params_seed: int = 0
    name: str = "audio"

    @classmethod
    def light(cls, **overrides: Any) -> AudioSynth:
        """A small, fast configuration (8 hidden units, 32 samples per step at 4 kHz, 16 steps)."""
        config: dict[str, Any] = dict(
            hidden_size=8, samples_per_step=32, sample_rate=4000.0, max_episode_steps=16
        )
        config.update(overrides)
        return cls(**config)

    @property
    def observation_space(self) -> Box:
        """The frame's `samples_per_step` samples in [-1, 1], then the target level."""
        low = (-1.0,) * self.samples_per_step + (self.target_low,)
        high = (1.0,) * self.samples_per_step + (self.target_high,)
        return Box((self.samples_per_step + 1,), low, high)

    @property
    def action_space(self) -> Space:
        """Gain down / keep / up (`Discrete(3)`), or a change in [-1, 1] with `discrete=False`."""
        if self.discrete:
            return Discrete(3)
        return Box.uniform((1,), -1.0, 1.0)

    def default_params(self) -> SynthParams:
        """Fixed synthesiser weights from `params_seed`, used when `params` is None."""
        return init_synth_params(jax.random.PRNGKey(self.params_seed), self.hidden_size)

    def _params(self, params: SynthParams | None) -> SynthParams:
        if params is None:
            return self.default_params()
        h = self.hidden_size
        expected = SynthParams((3 * h,), (h, 3 * h), (3 * h,), (h,), (h,), ())
        got = SynthParams(*(tuple(jnp.shape(p)) for p in params))
        if got != expected:
            raise ValueError(
                f"synth params do not fit hidden_size={h}: shapes {got._asdict()}, expected "
                f"{expected._asdict()} (build them with init_synth_params(key, {h}))"
            )
        return params

    def _obs(self, audio: Array, target: Array) -> Array:
        return jnp.concatenate([audio, target[None]]).astype(jnp.float32)

    def reset(self, key: PRNGKey, params: SynthParams | None = None) -> tuple[AudioState, Array]:
        """A new episode: tone, phase, gain and target drawn with `key`; the frame is silence.

        `params` is unused (nothing is synthesised yet); it is there to match `step`.
        """
        del params  # the first frame is silence: nothing to synthesise yet
        k_freq, k_phase, k_gain, k_target = jax.random.split(key, 4)
        log_f = jax.random.uniform(
            k_freq, (), jnp.float32, math.log(self.f_min), math.log(self.f_max)
        )
        state = AudioState(
            h=jnp.zeros((self.hidden_size,), jnp.float32),
            phase=jax.random.uniform(k_phase, (), jnp.float32, 0.0, 2 * math.pi),
            freq=jnp.exp(log_f),
            gain=jax.random.uniform(k_gain, (), jnp.float32, 0.0, self.max_gain),
            target=jax.random.uniform(k_target, (), jnp.float32, self.target_low, self.target_high),
            t=jnp.int32(0),
        )
        return state, self._obs(jnp.zeros((self.samples_per_step,), jnp.float32), state.target)

    def step(
        self,
        state: AudioState,
        action: Array,
        key: PRNGKey,
        params: SynthParams | None = None,
    ) -> tuple[AudioState, Array, Array, Array, Array, Info]:
        """Changes the gain, synthesises one frame with `params` (`None`: `default_params()`).

        Returns `(state, obs, reward, terminated, truncated, info)`; the reward is
        `-|level - target|`, `info` holds the frame's `level` and the new `gain`. `key` is unused.
        """
        del key
        params = self._params(params)
        if self.discrete:
            valid = valid_discrete_action(jnp.reshape(action, ()), 3, self.name)
            delta = (jnp.asarray(action, jnp.float32).reshape(()) - 1.0) * self.gain_step
            delta = jnp.where(valid, delta, jnp.nan)  # NaN gain, audio and reward: not a number
        else:
            delta = jnp.clip(jnp.asarray(action, jnp.float32).reshape(()), -1.0, 1.0)
            delta = delta * self.gain_step
        gain = jnp.clip(state.gain + delta, 0.0, self.max_gain)
        increments = jnp.arange(1, self.samples_per_step + 1, dtype=jnp.float32)
        phases = state.phase + (2 * math.pi / self.sample_rate) * state.freq * increments
        h, audio = synthesize(params, state.h, gain * jnp.sin(phases))
        level = jnp.sqrt(jnp.mean(jnp.square(audio - jnp.mean(audio))))
        reward = -jnp.abs(level - state.target)
        t = jnp.asarray(state.t, jnp.int32) + 1
        new_state = AudioState(
            h=h,
            phase=jnp.mod(phases[-1], 2 * math.pi),
            freq=state.freq,
            gain=gain,
            target=state.target,
            t=t,
        )
        terminated = jnp.zeros((), jnp.bool_)
        truncated = t >= self.max_episode_steps
        info = {"level": level, "gain": gain}
        return new_state, self._obs(audio, state.target), reward, terminated, truncated, info
