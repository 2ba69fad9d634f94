"""Environments people actually use (gymnasium, MuJoCo, EnvPool), stepped on CPU cores from
inside a jitted, member-sharded program.

``rollout.envs.make('gymnasium:HalfCheetah-v5')`` returns a :class:`HostEnv`; the PPO learner
binds it to its members (:meth:`HostEnv.bind` -> :class:`HostEnvs`), each device's members on
their own worker processes (gymnasium) or their own EnvPool pool and its C++ threads (EnvPool).
See ``rollout/hostenv/_host.py`` for why steps can never be reordered, dropped or duplicated.
"""

from rollout.hostenv._group import HostEnvError, WorkerGroup
from rollout.hostenv._host import HostEnv, HostEnvs, HostState

__all__ = ["HostEnv", "HostEnvError", "HostEnvs", "HostState", "WorkerGroup"]
