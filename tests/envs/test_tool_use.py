"""Every documented rule of ToolUseEnv, as a case."""

import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

import masked_rl_envs
from masked_rl_envs import HARD_KWARGS, OraclePolicy, ToolUseEnv
from masked_rl_envs.tool_use import ANSWER, BOS, CALL, END, EOS, ERROR, PAD, RESULT

V0_ORACLE_STEPS = 3 + 2 * (1 + 16) + 3 + 4  # prompt, two one-token calls, answer, closing
HARD_ORACLE_STEPS = 4 + 3 * (2 + 48) + 4 + 8


def play(env, agent_tokens, *, seed=0, masked_action=None):
    """Step ``env`` writing ``agent_tokens`` on agent steps until they run out or it ends.

    Returns one record per step: the written token, the loss_mask of the observation the step
    was taken from, reward, terminated, truncated. On masked steps ``masked_action`` (default:
    the next agent token, to show it is ignored) is passed as the action.
    """
    obs, _ = env.reset(seed=seed)
    agent_tokens = list(agent_tokens)
    records = []
    while True:
        mask = int(obs["loss_mask"][0])
        if mask:
            if not agent_tokens:
                return records
            action = agent_tokens.pop(0)
        else:
            action = masked_action if masked_action is not None else (agent_tokens or [0])[0]
        obs, reward, terminated, truncated, info = env.step(action)
        records.append((int(obs["tokens"][-1]), mask, reward, terminated, truncated))
        if terminated or truncated:
            return records


def run_policy(env, policy, seed):
    obs, info = env.reset(seed=seed)
    rewards, masks = [], []
    while True:
        masks.append(int(obs["loss_mask"][0]))
        obs, reward, terminated, truncated, info = env.step(policy(obs))
        rewards.append(reward)
        if terminated or truncated:
            return rewards, masks, terminated, truncated, info


def call(env, key_index):
    """The agent tokens of a call: ``[key]``, or ``[CALL, key]`` with ``call_prefix``."""
    key = env.grammar.key(key_index)
    return [CALL, key] if env.grammar.call_prefix else [key]


def oracle_tokens(env, seed):
    """The agent tokens the oracle writes in the episode seeded ``seed``."""
    env.reset(seed=seed)
    g = env.grammar
    calls = [t for q in env.queries for t in call(env, q)]
    return calls + [ANSWER] + [g.value(int(env.table[q])) for q in env.queries]


# -- oracle and random play ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "env_id, seeds, steps, agent_steps, episode_return",
    [
        ("MaskedRL/ToolUse-v0", 300, V0_ORACLE_STEPS, 5, 1.0 + 2 * 0.1),
        ("MaskedRL/ToolUseHard-v0", 40, HARD_ORACLE_STEPS, 10, 1.0 - 3 * 0.01),
    ],
)
def test_oracle_solves_every_episode(env_id, seeds, steps, agent_steps, episode_return):
    env = gym.make(env_id)
    policy = OraclePolicy.from_env(env)
    for seed in range(seeds):
        rewards, masks, terminated, truncated, info = run_policy(env, policy, seed)
        assert terminated and not truncated and info["is_success"]
        assert rewards[-1] == 1.0
        assert sum(rewards) == pytest.approx(episode_return)
        assert len(rewards) == steps
        assert sum(masks) == agent_steps == info["num_agent_tokens"]


@pytest.mark.parametrize("env_id, episodes", [("MaskedRL/ToolUse-v0", 1000), ("MaskedRL/ToolUseHard-v0", 200)])
def test_uniform_random_policy_almost_never_succeeds(env_id, episodes):
    # Measured by `python -m masked_rl_envs.speed --random-episodes 50000`: 0.084 % on v0
    # (ANSWER and two right values by chance), 0 on the hard id. Bound: 0.5 %.
    env = gym.make(env_id)
    env.action_space.seed(0)
    successes = 0
    for seed in range(episodes):
        *_, info = run_policy(env, lambda obs: env.action_space.sample(), seed)
        successes += info["is_success"]
    assert successes <= episodes * 0.005


def test_oracle_recovers_from_a_malformed_turn():
    env = ToolUseEnv()
    policy = OraclePolicy.from_env(env)
    obs, _ = env.reset(seed=5)
    for _ in range(env.grammar.prompt_len):
        obs, *_ = env.step(0)
    obs, *_ = env.step(env.grammar.value(0))  # a turn that is neither CALL nor ANSWER
    while True:
        obs, reward, terminated, truncated, info = env.step(policy(obs))
        if terminated or truncated:
            break
    assert terminated and info["is_success"]


def test_oracle_needs_the_prompt_in_the_window():
    env = ToolUseEnv(window=8)
    policy = OraclePolicy.from_env(env)
    obs, _ = env.reset(seed=0)
    for _ in range(3 + 1 + 16):  # prompt, the first call, its response
        obs, *_ = env.step(policy(obs))  # the prompt is in the window at the first call
    assert obs["loss_mask"][0] == 1
    with pytest.raises(ValueError, match="reach back to the prompt"):
        policy(obs)


def test_oracle_policy_accepts_batches():
    env = ToolUseEnv()
    policy = OraclePolicy.from_env(env)
    observations = []
    obs, _ = env.reset(seed=0)
    for _ in range(6):
        observations.append(obs)
        obs, *_ = env.step(policy(obs))
    batch = {k: np.stack([o[k] for o in observations]).reshape(2, 3, -1) for k in obs}
    actions = policy(batch)
    assert actions.shape == (2, 3) and actions.dtype == np.int64
    assert actions.reshape(-1).tolist() == [policy(o) for o in observations]


# -- loss_mask, blocks and rewards --------------------------------------------------------------


@pytest.mark.parametrize("call_prefix", [False, True])
def test_loss_mask_and_tokens_per_phase(call_prefix):
    env = ToolUseEnv(call_prefix=call_prefix)
    tokens = oracle_tokens(env, seed=3)
    records = play(env, tokens, seed=3)
    written = [r[0] for r in records]
    masks = [r[1] for r in records]
    g = env.grammar
    k_a, k_b = (g.key(q) for q in env.queries)
    v_a, v_b = (g.value(int(env.table[q])) for q in env.queries)
    filler = [g.filler(0)] * 12
    prefix = [CALL] if call_prefix else []
    assert written == (
        [BOS, k_a, k_b]
        + prefix + [k_a] + [RESULT, k_a, v_a, *filler, END]
        + prefix + [k_b] + [RESULT, k_b, v_b, *filler, END]
        + [ANSWER, v_a, v_b] + [EOS] * 4
    )  # fmt: skip
    call_mask = [1] * (1 + call_prefix) + [0] * 16
    assert masks == [0] * 3 + call_mask * 2 + [1] * 3 + [0] * 4


def test_reset_observation_is_empty_and_masked():
    obs, info = ToolUseEnv().reset(seed=0)
    assert obs["tokens"].tolist() == [PAD] * 64
    assert obs["tokens"].dtype == np.int64 and obs["loss_mask"].dtype == np.int8
    assert obs["loss_mask"].tolist() == [0]
    assert info == {"is_success": False, "num_tool_calls": 0, "num_agent_tokens": 0}


def test_window_holds_the_latest_tokens_left_padded():
    env = ToolUseEnv(window=8)
    obs, _ = env.reset(seed=0)
    transcript = []
    for _ in range(20):
        obs, *_ = env.step(CALL if obs["loss_mask"][0] else 0)
        transcript.append(int(obs["tokens"][-1]))
        expected = ([PAD] * 8 + transcript)[-8:]
        assert obs["tokens"].tolist() == expected


def test_actions_on_masked_steps_are_ignored():
    env = ToolUseEnv()
    tokens = oracle_tokens(env, seed=7)
    reference = play(env, tokens, seed=7, masked_action=0)
    for masked_action in (CALL, ANSWER, env.grammar.value(2), env.action_space.n - 1):
        assert play(env, tokens, seed=7, masked_action=masked_action) == reference


def test_terminal_reward_on_the_last_masked_step():
    env = ToolUseEnv(lookup_reward=0.0)
    records = play(env, oracle_tokens(env, seed=1), seed=1)
    rewards = [r[2] for r in records]
    assert rewards[-1] == 1.0 and sum(rewards) == 1.0
    *_, (_, mask, _, terminated, truncated) = records
    assert mask == 0 and terminated and not truncated
    assert not any(r[3] or r[4] for r in records[:-1])


def test_wrong_answer_scores_zero_or_partial_credit():
    for partial_credit, expected in ((False, 0.0), (True, 0.5)):
        env = ToolUseEnv(partial_credit=partial_credit, lookup_reward=0.0)
        tokens = oracle_tokens(env, seed=2)
        right = tokens[-1]
        tokens[-1] = env.grammar.value((right - env.grammar.value(0) + 1) % 4)
        records = play(env, tokens, seed=2)
        assert records[-1][2] == expected and records[-1][3]
        assert sum(r[2] for r in records) == expected
    env = ToolUseEnv()
    play(env, [ANSWER, CALL, BOS], seed=0)  # non-value tokens are simply wrong answers
    assert not env._info()["is_success"]


@pytest.mark.parametrize("call_prefix", [False, True])
def test_shaping_rewards_on_the_step_after_the_call(call_prefix):
    kwargs = dict(call_cost=0.25, lookup_reward=0.5, max_steps=200, call_prefix=call_prefix)
    env = ToolUseEnv(**kwargs)
    g = env.grammar
    env.reset(seed=4)
    a, b = env.queries
    unasked = next(k for k in range(4) if k not in env.queries)
    v_a, v_b = (g.value(int(env.table[q])) for q in env.queries)
    turns = [call(env, a), call(env, a), call(env, unasked), [g.value(0)], call(env, b)]
    tokens = [t for turn in turns for t in turn] + [ANSWER, v_a, v_b]
    records = play(ToolUseEnv(**kwargs), tokens, seed=4)
    masks = [r[1] for r in records]
    rewards = [r[2] for r in records]
    block_starts = [t for t in range(1, len(masks)) if masks[t - 1] == 1 and masks[t] == 0]
    # Next queried key in order: bonus - cost; repeated, unasked or malformed: cost only.
    assert [rewards[t] for t in block_starts[:-1]] == [0.25, -0.25, -0.25, -0.25, 0.25]
    assert rewards[-1] == 1.0 and block_starts[-1] == len(rewards) - 4  # closing block
    others = set(range(len(rewards) - 1)) - set(block_starts[:-1])
    assert all(rewards[t] == 0.0 for t in others)


def test_lookup_reward_follows_the_order_asked():
    env = ToolUseEnv(max_steps=200)
    env.reset(seed=4)
    a, b = env.queries
    records = play(env, call(env, b) + call(env, a) + call(env, b) + call(env, a), seed=4)
    masks = [r[1] for r in records]
    block_starts = [t for t in range(1, len(masks)) if masks[t - 1] == 1 and masks[t] == 0]
    assert [records[t][2] for t in block_starts] == [0.0, 0.1, 0.1, 0.0]
    assert sum(r[2] for r in records) == pytest.approx(0.2)


@pytest.mark.parametrize("call_prefix", [False, True])
def test_malformed_turn_gets_an_error_block(call_prefix):
    env = ToolUseEnv(call_prefix=call_prefix)
    g = env.grammar
    malformed = [g.value(1), PAD, END, g.filler(0)]
    malformed += [g.key(0)] if call_prefix else [CALL]
    for bad in malformed:
        records = play(env, [bad], seed=0)
        block = [r[0] for r in records[4:]]
        assert block[:2] == [ERROR, bad] and block[-1] == END and len(block) == 16
        assert [r[1] for r in records[4:]] == [0] * 16
        assert env._observation()["loss_mask"].tolist() == [1]
        assert env._info()["num_tool_calls"] == 1


def test_call_on_a_non_key_gets_an_error_block():
    env = ToolUseEnv(call_prefix=True)
    g = env.grammar
    for bad in (g.value(0), CALL, ANSWER, g.filler(0)):
        records = play(env, [CALL, bad], seed=0)
        block = [r[0] for r in records[5:]]
        assert block[:3] == [ERROR, CALL, bad] and block[-1] == END and len(block) == 16
        assert env._info()["num_tool_calls"] == 1


def test_unnecessary_calls_are_answered_like_a_real_tool():
    env = ToolUseEnv(max_steps=200)
    g = env.grammar
    env.reset(seed=6)
    unasked = next(k for k in range(4) if k not in env.queries)
    asked = env.queries[0]
    records = play(env, call(env, unasked) + call(env, asked) * 2, seed=6)
    written = [r[0] for r in records]
    results = [written[i : i + 3] for i in range(len(written)) if written[i] == RESULT]
    assert results == [
        [RESULT, g.key(unasked), g.value(int(env.table[unasked]))],
        [RESULT, g.key(asked), g.value(int(env.table[asked]))],
        [RESULT, g.key(asked), g.value(int(env.table[asked]))],
    ]


@pytest.mark.parametrize("call_prefix", [False, True])
def test_calls_beyond_the_quota_get_an_error_block(call_prefix):
    env = ToolUseEnv(max_calls=1, max_steps=200, call_prefix=call_prefix)
    env.reset(seed=0)
    tokens = call(env, env.queries[0])
    records = play(env, tokens * 2, seed=0)
    written = [r[0] for r in records]
    first = 3 + len(tokens)
    second = first + 16 + len(tokens)
    assert written[first] == RESULT
    assert written[second : second + 1 + len(tokens)] == [ERROR, *tokens]
    assert env._info()["num_tool_calls"] == 2


def test_running_out_of_steps_truncates():
    env = ToolUseEnv(max_steps=10)
    records = play(env, [env.grammar.key(0)] * 3, seed=0)
    assert len(records) == 10
    assert records[-1][4] and not records[-1][3] and records[-1][1] == 0  # mid-block
    assert not any(r[3] or r[4] for r in records[:-1])
    with pytest.raises(RuntimeError, match="reset"):
        env.step(0)
    # Junk turns fill the default budget: truncation, nothing earned.
    records = play(ToolUseEnv(), [env.grammar.value(0)] * 10, seed=0)
    assert len(records) == 80 and records[-1][4] and sum(r[2] for r in records) == 0


def test_terminating_on_the_last_budget_step_is_not_truncation():
    env = ToolUseEnv(max_steps=V0_ORACLE_STEPS)
    records = play(env, oracle_tokens(env, seed=0), seed=0)
    assert len(records) == V0_ORACLE_STEPS and records[-1][3] and not records[-1][4]


def test_info_counts():
    env = ToolUseEnv()
    play(env, [env.grammar.key(0), PAD], seed=0)
    assert env._info() == {"is_success": False, "num_tool_calls": 2, "num_agent_tokens": 2}


# -- seeding, rendering, arguments -------------------------------------------------------------


def test_same_seed_same_transcript():
    def transcripts(seed):
        env = gym.make("MaskedRL/ToolUseHard-v0", render_mode="ansi")
        env.action_space.seed(seed)
        out = []
        for episode in range(3):
            obs, _ = env.reset(seed=seed if episode == 0 else None)
            observations = [obs["tokens"].copy()]
            done = False
            while not done:
                obs, _, terminated, truncated, _ = env.step(env.action_space.sample())
                observations.append(obs["tokens"].copy())
                done = terminated or truncated
            out.append((env.render(), np.stack(observations)))
        return out

    first, again, other = transcripts(11), transcripts(11), transcripts(12)
    for (text_a, obs_a), (text_b, obs_b) in zip(first, again):
        assert text_a == text_b and np.array_equal(obs_a, obs_b)
    assert [t for t, _ in first] != [t for t, _ in other]


def test_episodes_differ_across_seeds():
    env = ToolUseEnv()
    prompts = set()
    for seed in range(50):
        env.reset(seed=seed)
        prompts.add((tuple(env.queries), tuple(env.table.tolist())))
    assert len(prompts) > 40


def test_render_ansi_marks_environment_spans():
    env = ToolUseEnv(render_mode="ansi")
    play(env, oracle_tokens(env, seed=3), seed=3)
    text = env.render()
    g = env.grammar
    k_a, k_b = (g.token_name(g.key(q)) for q in env.queries)
    assert text.startswith(f"[<bos> {k_a} {k_b}] {k_a} [RESULT {k_a} ")
    assert text.endswith("[<eos> <eos> <eos> <eos>]")
    assert text.count("[") == text.count("]") == 4
    with pytest.warns(UserWarning, match="without specifying any render mode"):
        assert ToolUseEnv().render() is None


def test_check_env():
    # Through gymnasium.make so that the env has a spec and check_env also tries render modes.
    check_env(gym.make("MaskedRL/ToolUse-v0").unwrapped)
    check_env(gym.make("MaskedRL/ToolUseHard-v0", render_mode="ansi").unwrapped)
    check_env(gym.make("MaskedRL/ToolUse-v0", call_prefix=True, n_filler=3).unwrapped)
    assert gym.spec("MaskedRL/ToolUseHard-v0").kwargs == HARD_KWARGS


def test_registered_ids_and_spaces():
    assert gym.spec("MaskedRL/ToolUse-v0").kwargs == {}
    v0, hard = gym.make("MaskedRL/ToolUse-v0"), gym.make("MaskedRL/ToolUseHard-v0")
    assert v0.action_space == gym.spaces.Discrete(17)
    assert v0.observation_space["tokens"].shape == (64,)
    assert v0.observation_space["loss_mask"].shape == (1,)
    assert hard.action_space == gym.spaces.Discrete(32)
    assert hard.observation_space["tokens"].shape == (256,)
    assert gym.make("MaskedRL/ToolUse-v0", response_len=24).unwrapped.grammar.response_len == 24


def test_make_from_a_fresh_interpreter():
    code = (
        "import gymnasium as gym\n"
        "env = gym.make('masked_rl_envs:MaskedRL/ToolUse-v0')\n"
        "obs, info = env.reset(seed=0)\n"
        "print(env.action_space.n, obs['tokens'].shape, gym.make('MaskedRL/ToolUseHard-v0'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.startswith("17 (64,) ")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_keys=0), "n_keys must be an integer >= 1, got 0"),
        (dict(n_values=2.5), "n_values must be an integer >= 1, got 2.5"),
        (dict(n_queries=5), r"n_queries must be <= n_keys \(4\).*got 5"),
        (dict(response_len=3), "response_len must be an integer >= 4, got 3"),
        (dict(closing_len=0), "closing_len must be an integer >= 1, got 0"),
        (dict(n_filler=True), "n_filler must be an integer >= 1, got True"),
        (dict(window=0), "window must be an integer >= 1, got 0"),
        (dict(max_steps=-1), "max_steps must be an integer >= 1, got -1"),
        (dict(max_calls=-1), "max_calls must be an integer >= 0, got -1"),
        (dict(call_cost=-0.1), "call_cost must be a finite float >= 0, got -0.1"),
        (dict(lookup_reward=float("nan")), "lookup_reward must be a finite float >= 0, got nan"),
        (dict(partial_credit=1), "partial_credit must be a bool, got 1"),
        (dict(render_mode="human"), r"render_mode must be None or one of \['ansi'\], got 'human'"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ToolUseEnv(**kwargs)


def test_bad_agent_action_raises_value_error():
    env = ToolUseEnv()
    env.reset(seed=0)
    for _ in range(3):
        env.step(999)  # masked: ignored, whatever it is
    with pytest.raises(ValueError, match=r"action must be in \[0, 17\), got 17"):
        env.step(17)


@pytest.mark.parametrize("action", [10.9, 3.0, "3", b"3", True, np.bool_(True), np.float32(3),
                                    np.array([1, 2]), None, 2**70])
def test_agent_action_must_be_one_integer(action):
    env = ToolUseEnv()
    env.reset(seed=0)
    for _ in range(3):
        env.step(0)
    with pytest.raises(ValueError, match=r"action must be one integer in \[0, 17\), got "):
        env.step(action)


@pytest.mark.parametrize("action", [11, np.int64(11), np.uint8(11), np.array(11),
                                    np.array([11]), torch.tensor(11)])
def test_agent_action_accepts_python_numpy_and_torch_integers(action):
    env = ToolUseEnv()
    env.reset(seed=0)
    for _ in range(3):
        env.step(0)
    env.step(action)
    assert env.transcript().split()[-1].startswith("k")  # token 11 is key k1: a lookup


def test_use_before_reset_says_so():
    env = ToolUseEnv()
    with pytest.raises(RuntimeError, match=r"step\(\) called before reset\(\)"):
        env.step(0)
    with pytest.raises(RuntimeError, match=r"table called before reset\(\)"):
        env.table
    with pytest.raises(RuntimeError, match=r"queries called before reset\(\)"):
        env.queries
    env.reset(seed=0)
    assert env.table.shape == (4,)


# -- vector environments -----------------------------------------------------------------------


@pytest.mark.parametrize("vector_cls", [gym.vector.SyncVectorEnv, gym.vector.AsyncVectorEnv])
def test_vector_env_runs_the_oracle(vector_cls):
    envs = vector_cls([lambda: gym.make("masked_rl_envs:MaskedRL/ToolUse-v0")] * 3)
    try:
        policy = OraclePolicy.from_env(envs)
        obs, _ = envs.reset(seed=0)
        assert obs["tokens"].shape == (3, 64) and obs["loss_mask"].shape == (3, 1)
        successes, episodes = 0, 0
        for _ in range(3 * V0_ORACLE_STEPS):
            obs, reward, terminated, truncated, info = envs.step(policy(obs))
            assert not truncated.any()
            episodes += int(terminated.sum())
            successes += int((terminated & (reward == 1.0)).sum())
        assert episodes == successes >= 6
    finally:
        envs.close()


def test_gymnasium_make_vec():
    envs = gym.make_vec("MaskedRL/ToolUse-v0", num_envs=2, vectorization_mode="sync")
    obs, _ = envs.reset(seed=0)
    assert obs["tokens"].shape == (2, 64)
    envs.close()


def test_package_exports():
    assert {"ToolUseEnv", "OraclePolicy", "make_torchrl_env", "oracle_action"} <= set(
        masked_rl_envs.__all__
    )
