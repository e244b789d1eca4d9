"""TorchRL entry point: the registered environments as a TorchRL ``EnvBase``."""

from __future__ import annotations

from functools import partial


def _qualified_id(env_id: str) -> str:
    # "module:Namespace/Name-v0" makes gymnasium import the registering module first, which
    # matters in worker processes that never imported masked_rl_envs themselves.
    if ":" not in env_id and env_id.startswith("MaskedRL/"):
        return f"masked_rl_envs:{env_id}"
    return env_id


def _gym_env(env_id: str, num_envs: int, device, categorical_action_encoding: bool, env_kwargs):
    from torchrl.envs import GymEnv

    if num_envs > 1:
        env_kwargs = {**env_kwargs, "num_envs": num_envs}
    return GymEnv(
        env_id,
        device=device,
        categorical_action_encoding=categorical_action_encoding,
        **env_kwargs,
    )


def make_torchrl_env(
    env_id: str = "MaskedRL/ToolUse-v0",
    num_envs: int = 1,
    workers: int = 1,
    device="cpu",
    *,
    serial: bool = False,
    categorical_action_encoding: bool = True,
    seed: int | None = None,
    **env_kwargs,
):
    """A TorchRL environment running ``env_id`` with batch size ``[workers * num_envs]``.

    - ``workers == 1, num_envs == 1``: a ``GymEnv``, batch size ``[]``.
    - ``workers == 1, num_envs > 1``: a ``GymEnv`` over a gymnasium ``AsyncVectorEnv``
      (one subprocess per env), batch size ``[num_envs]``.
    - ``workers > 1``: a ``ParallelEnv`` (``SerialEnv`` if ``serial``) of ``workers`` such
      environments, batch size ``[workers]`` or ``[workers, num_envs]``.

    Nothing else is appended (no transform). Keys of a step, per environment:
    ``"tokens"`` int64 ``[W]``, ``"loss_mask"`` int8 ``[1]``, ``"action"`` int64 ``[]`` (the
    token id; one-hot ``[V]`` if ``categorical_action_encoding=False``), ``"done"``,
    ``"terminated"``, ``"truncated"`` bool ``[1]``, and ``("next", "reward")`` float32 ``[1]``.
    In a rollout the root ``"loss_mask"`` at step ``t`` is that of the observation the action
    was taken from, so it says whether ``"action"`` at ``t`` is the agent's; the terminal
    reward sits in ``("next", "reward")`` of the last, masked step.

    ``env_kwargs`` go to the environment constructor (``response_len=24``, ``max_steps=...``).
    ``seed`` calls ``env.set_seed(seed)``.
    """
    if not isinstance(num_envs, int) or num_envs < 1:
        raise ValueError(f"num_envs must be an integer >= 1, got {num_envs!r}")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    make = partial(
        _gym_env,
        _qualified_id(env_id),
        num_envs,
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
