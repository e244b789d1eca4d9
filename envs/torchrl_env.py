"""TorchRL entry point: the registered environments as a TorchRL ``EnvBase``."""

from __future__ import annotations

from functools import partial

VECTORIZATIONS = ("sync", "async")
BACKENDS = ("gym", "batched")


def _qualified_id(env_id: str) -> str:
    # "module:Namespace/Name-v0" makes gymnasium import the registering module first, which
    # matters in worker processes that never imported masked_rl_envs themselves.
    if ":" not in env_id and env_id.startswith("MaskedRL/"):
        return f"masked_rl_envs:{env_id}"
    return env_id


def _final_observation_in_final_info(vector_env):
    """Copy each key of the final observations into ``info["final_info"]``.

    TorchRL 0.14's reader of auto-reset vector envs (``terminal_obs_reader``) looks the final
    observation of a ``Dict`` space up per key in ``info["final_info"]`` and otherwise writes
    zeros: every episode's last ``("next", "tokens")`` would be all ``<pad>``, and a truncated
    episode would bootstrap from the value of that empty window instead of its last one.
    """
    import gymnasium as gym
    import numpy as np

    spaces = vector_env.single_observation_space.spaces

    class FinalObservationInFinalInfo(gym.vector.VectorWrapper):
        @property
        def autoreset_mode(self):  # read by GymWrapper
            return self.env.autoreset_mode

        def step(self, actions):
            obs, reward, terminated, truncated, infos = self.env.step(actions)
            if "final_obs" in infos:
                final_info = dict(infos.get("final_info", {}))
                for key, space in spaces.items():
                    stacked = np.zeros((self.num_envs, *space.shape), dtype=space.dtype)
                    for i in np.flatnonzero(infos["_final_obs"]):
                        stacked[i] = infos["final_obs"][i][key]
                    final_info[key] = stacked
                infos = {**infos, "final_info": final_info}
            return obs, reward, terminated, truncated, infos

    return FinalObservationInFinalInfo(vector_env)


def _single_worker_env(env_id, num_envs, backend, vectorization, device, categorical_action_encoding,
                       env_kwargs):
    if backend == "batched":
        from masked_rl_envs.tool_use_batched import ToolUseBatchedEnv

        return ToolUseBatchedEnv.from_id(
            env_id, num_envs, device=device, categorical_action_encoding=categorical_action_encoding,
            **env_kwargs,
        )
    import gymnasium as gym
    from torchrl.envs import GymEnv, GymWrapper

    from masked_rl_envs import time_limit_kwargs

    env_kwargs = time_limit_kwargs(env_kwargs)

    if num_envs == 1:
        import torch
        from torchrl.data import Unbounded
        from torchrl.envs import default_info_dict_reader

        env = GymEnv(
            env_id, device=device, categorical_action_encoding=categorical_action_encoding, **env_kwargs
        )
        # Vector envs below come with an info reader already. Given specs, TorchRL need not
        # probe the env with a dummy rollout.
        dtypes = {"is_success": torch.bool, "num_tool_calls": torch.int64, "num_agent_tokens": torch.int64}
        specs = [Unbounded((), dtype=dtype, device=device) for dtype in dtypes.values()]
        env.set_info_dict_reader(default_info_dict_reader(list(dtypes), spec=specs))
        return env
    # TorchRL reads gymnasium >= 1.1 vector envs only in the SAME_STEP auto-reset mode, where
    # the info of a done step is the finished episode's (GymEnv(num_envs=...) loses it).
    vector_env = gym.make_vec(
        env_id,
        num_envs=num_envs,
        vectorization_mode=vectorization,
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
        **env_kwargs,
    )
    return GymWrapper(
        _final_observation_in_final_info(vector_env),
        categorical_action_encoding=categorical_action_encoding,
        device=device,
    )


def make_torchrl_env(
    env_id: str = "MaskedRL/ToolUse-v0",
    num_envs: int = 1,
    workers: int = 1,
    device="cpu",
    *,
    backend: str = "gym",
    vectorization: str = "sync",
    serial: bool = False,
    categorical_action_encoding: bool = True,
    seed: int | None = None,
    **env_kwargs,
):
    """``env_id`` as a TorchRL environment with batch size ``[]``, ``[num_envs]``,
    ``[workers]`` or ``[workers, num_envs]``.

    - ``workers == 1, num_envs == 1``: a ``GymEnv``, batch size ``[]``.
    - ``workers == 1, num_envs > 1``: batch size ``[num_envs]``. ``vectorization="sync"``
      (default): a ``GymWrapper`` over gymnasium's ``SyncVectorEnv`` (``SAME_STEP``
      auto-reset), every env stepped in this process, which is the fastest for these
      microsecond environments; ``"async"``: over gymnasium's ``AsyncVectorEnv``, one
      subprocess per env. Both keep the final observation and info of every episode in
      ``"next"``, which TorchRL 0.14.1's own ``GymEnv(env_id, num_envs=N)`` does not for
      ``Dict`` observations (it writes zeros there, so a truncated episode would bootstrap
      from an empty window).
    - ``backend="batched"``: a :class:`~masked_rl_envs.ToolUseBatchedEnv`, the ``num_envs``
      environments stepped together with tensor operations (same rules, keys, dtypes and
      shapes; a recipe collector gathers 1.9-3.8x the frames per second, see
      ``python -m masked_rl_benchmarks.collector``), batch size ``[num_envs]`` also for
      ``num_envs == 1``; ``vectorization`` does not apply, ``env_kwargs`` may also hold its
      ``tokens_dtype``. Its episodes come from a torch generator: a seed gives other tasks
      than with the default ``backend="gym"``.
    - ``workers > 1``: a ``ParallelEnv`` (``SerialEnv`` if ``serial``) of ``workers`` copies
      of the above.

    No transform is appended. Keys of a step, per environment: ``"tokens"`` int64 ``[W]``,
    ``"loss_mask"`` int8 ``[1]``, ``"action"`` int64 ``[]`` (the token id; one-hot int64
    ``[V]`` if ``categorical_action_encoding=False``), ``"done"``, ``"terminated"``,
    ``"truncated"`` bool ``[1]``, and ``("next", "reward")`` float32 ``[1]``. In a rollout
    the root ``"loss_mask"`` at step ``t`` belongs to the observation the action was taken
    from: it says whether ``"action"`` at ``t`` is the agent's. The terminal reward sits in
    ``("next", "reward")`` of the episode's last step, a masked one. The info dict is read
    into ``"is_success"`` (bool ``[]``), ``"num_tool_calls"`` and ``"num_agent_tokens"``
    (int64 ``[]``); ``("next", "is_success")`` on a done step tells whether that episode
    was solved.

    ``env_kwargs`` go to the environment constructor (``response_len=24``, ``max_steps=...``);
    ``seed`` calls ``env.set_seed(seed)``. Subprocess-based variants (``"async"``,
    ``ParallelEnv``) start workers with TorchRL's ``spawn`` method: call them under
    ``if __name__ == "__main__":`` in scripts.

    Example:
        >>> import masked_rl_envs
        >>> env = masked_rl_envs.make_torchrl_env(seed=0)
        >>> policy = masked_rl_envs.OraclePolicy.from_id("MaskedRL/ToolUse-v0").as_module()
        >>> rollout = env.rollout(100, policy)  # stops at the end of the first episode
        >>> rollout["loss_mask"].squeeze(-1).tolist()[:8]
        [0, 0, 0, 1, 0, 0, 0, 0]
        >>> rollout["next", "reward"].squeeze(-1)[-1].item(), rollout["next", "is_success"][-1].item()
        (1.0, True)
    """
    if not isinstance(num_envs, int) or num_envs < 1:
        raise ValueError(f"num_envs must be an integer >= 1, got {num_envs!r}")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    if vectorization not in VECTORIZATIONS:
        raise ValueError(f"vectorization must be one of {VECTORIZATIONS}, got {vectorization!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "batched" and vectorization != "sync":
        raise ValueError(
            f"vectorization={vectorization!r} applies to backend='gym' only; backend='batched' "
            "steps its environments together in this process"
        )
    make = partial(
        _single_worker_env,
        _qualified_id(env_id),
        num_envs,
        backend,
        vectorization,
        device,
        categorical_action_encoding,
        env_kwargs,
    )
    if workers == 1:
        env = make()
    else:
        from torchrl.envs import ParallelEnv, SerialEnv

        batched = SerialEnv if serial else ParallelEnv
        env = batched(workers, make, device=device)
    if seed is not None:
        env.set_seed(seed)
    return env
