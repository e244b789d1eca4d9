"""ToolUseBatchedEnv against ToolUseEnv, episode by episode, token by token.

Each test rolls the batched env out, then replays every episode of every environment through a
plain ToolUseEnv given the same draws (the batched env's table and queried keys, and the filler
words it wrote) and the same actions, and compares every observation, loss_mask, reward, flag
and info.
"""

import numpy as np
import pytest
import torch
from torchrl.envs.utils import check_env_specs

from masked_rl_envs import (
    CLOSING64_KWARGS,
    HARD_KWARGS,
    LONG64_KWARGS,
    LONG256_KWARGS,
    OraclePolicy,
    ToolUseBatchedEnv,
    ToolUseEnv,
    make_torchrl_env,
    oracle_action,
)
from masked_rl_envs.tool_use import ANSWER, CALL, END, ERROR, RESULT

IDS = {
    "MaskedRL/ToolUse-v0": {},
    "MaskedRL/ToolUseHard-v0": HARD_KWARGS,
    "MaskedRL/ToolUseClosing64-v0": CLOSING64_KWARGS,
    "MaskedRL/ToolUseLong64-v0": LONG64_KWARGS,
    "MaskedRL/ToolUseLong256-v0": LONG256_KWARGS,
}


class ScriptedRandom:
    """Stands in for ``ToolUseEnv.np_random``: hands out the batched env's draws of one episode.

    ``ToolUseEnv.reset`` draws the table (``integers``) then the queries (``choice``); every
    response block then draws its filler words (``integers``), which are read back from the
    batched env's written tokens at the positions the reference env is about to fill.
    """

    def __init__(self, env: ToolUseEnv, table, queries, written):
        self.env, self.table, self.queries, self.written = env, table, queries, written
        self.drew_table = False

    def integers(self, low, high, size):
        g = self.env.grammar
        if not self.drew_table:
            assert (low, high, size) == (0, g.n_values, g.n_keys)
            assert ((0 <= self.table) & (self.table < g.n_values)).all()
            self.drew_table = True
            return self.table.copy()
        assert (low, high) == (0, g.n_filler)
        # The response block starts after the agent token of this step (index _num_steps); its
        # head takes response_len - 1 - size tokens.
        start = self.env._num_steps + 1 + (g.response_len - 1 - size)
        words = self.written[start : start + size] - g.filler(0)
        assert ((0 <= words) & (words < g.n_filler)).all(), words
        # Past the end of the episode (truncated inside the block): never written, any word.
        return np.concatenate([words, np.zeros(size - len(words), dtype=np.int64)])

    def choice(self, n, size, replace):
        assert (n, size, replace) == (self.env.grammar.n_keys, self.env.grammar.n_queries, False)
        assert len(set(self.queries.tolist())) == size and (self.queries < n).all()
        return self.queries.copy()


def rollout(env, steps, choose):
    """``env.rollout`` with ``choose(td) -> actions``, recording each step's hidden table and queries."""
    tables, queries = [], []

    def policy(td):
        tables.append(env.table)
        queries.append(env.queries)
        td["action"] = choose(td)
        return td

    td = env.rollout(steps, policy, break_when_any_done=False)
    return td, torch.stack(tables, 1).numpy(), torch.stack(queries, 1).numpy()


def replay(env_kwargs, td, tables, queries):
    """Replay every episode of ``td`` ``[N, T]`` through ``ToolUseEnv``; assert equality of
    every step. Returns one summary per episode: the reference env after its last step."""
    arrays = {
        key: td[key].numpy()
        for key in [
            "tokens", "loss_mask", "action", "is_success", "num_tool_calls", "num_agent_tokens",
            ("next", "tokens"), ("next", "loss_mask"), ("next", "reward"), ("next", "done"),
            ("next", "terminated"), ("next", "truncated"), ("next", "is_success"),
            ("next", "num_tool_calls"), ("next", "num_agent_tokens"),
        ]
    }
    num_envs, steps = td.batch_size
    finished = []
    for i in range(num_envs):
        done = arrays["next", "done"][i, :, 0]
        starts = [0, *(np.flatnonzero(done) + 1)]
        for start in starts:
            if start >= steps:
                continue
            end = steps if not done[start:].any() else start + int(np.argmax(done[start:])) + 1
            written = arrays["next", "tokens"][i, start:end, -1]
            ref = ToolUseEnv(**env_kwargs)
            ref.np_random = ScriptedRandom(ref, tables[i, start], queries[i, start], written)
            obs, info = ref.reset()
            where = f"env {i}, episode from step {start}"
            check_step(arrays, (i, start), obs, info, root=True, where=where)
            for t in range(start, end):
                obs, reward, terminated, truncated, info = ref.step(arrays["action"][i, t])
                where = f"env {i}, step {t} (episode step {t - start})"
                check_step(arrays, (i, t), obs, info, root=False, where=where)
                assert arrays["next", "reward"][i, t, 0] == np.float32(reward), where
                assert arrays["next", "terminated"][i, t, 0] == terminated, where
                assert arrays["next", "truncated"][i, t, 0] == truncated, where
                assert arrays["next", "done"][i, t, 0] == (terminated or truncated), where
            finished.append(ref)
    return finished


def check_step(arrays, index, obs, info, *, root, where):
    prefix = () if root else ("next",)

    def get(key):
        return arrays[(*prefix, key) if prefix else key][index]

    np.testing.assert_array_equal(get("tokens"), obs["tokens"], err_msg=where)
    assert get("loss_mask").tolist() == obs["loss_mask"].tolist(), where
    for key in ("is_success", "num_tool_calls", "num_agent_tokens"):
        assert get(key) == info[key], (where, key)


def random_tokens(env, generator, weights=None):
    """Random tokens from ``weights`` over the vocabulary (uniform by default), on every step."""
    n, vocab = env.batch_size[0], env.grammar.vocab_size
    weights = torch.ones(vocab) if weights is None else weights

    def choose(td):
        return torch.multinomial(weights.expand(n, vocab), 1, generator=generator).squeeze(-1)

    return choose


def call_heavy_weights(grammar):
    """Mostly calls and keys (quota errors, repeated and out-of-order lookups), some answers."""
    weights = torch.full((grammar.vocab_size,), 0.2)
    weights[CALL] = 3.0 * grammar.n_keys if grammar.call_prefix else 0.2
    weights[ANSWER] = 0.4
    weights[grammar.key(0) : grammar.key(grammar.n_keys)] = 3.0
    weights[grammar.value(0) : grammar.value(grammar.n_values)] = 0.5
    return weights


def oracle_with_wasted_turns(env, generator, probability=0.2):
    """The oracle, except that each agent step is a random token with ``probability``."""
    vocab = env.grammar.vocab_size

    def oracle(tokens, loss_mask):
        try:
            return oracle_action({"tokens": tokens, "loss_mask": loss_mask}, env.grammar)
        except ValueError:  # the prompt scrolled out of a short window: a random token
            return int(torch.randint(vocab, (), generator=generator))

    def choose(td):
        actions = torch.tensor([oracle(*row) for row in zip(td["tokens"].numpy(), td["loss_mask"].numpy())])
        n = len(actions)
        noise = torch.rand(n, generator=generator) < probability
        return torch.where(noise, torch.randint(vocab, (n,), generator=generator), actions)

    return choose


def response_heads(refs):
    """Every response block's head in the reference transcripts, as token-name tuples."""
    heads = []
    for ref in refs:
        g = ref.grammar
        transcript = ref._transcript[: ref._num_steps].tolist()
        for pos, token in enumerate(transcript):
            if token in (RESULT, ERROR) and ref._written_by_env[pos] and not ref._written_by_env[pos - 1]:
                heads.append(tuple(g.token_name(t) for t in transcript[pos : pos + 3]))
    return heads


# -- exactness ----------------------------------------------------------------------------------


@pytest.mark.parametrize("env_id", list(IDS))
def test_oracle_episodes_match_tool_use_env(env_id):
    kwargs = IDS[env_id]
    env = ToolUseBatchedEnv.from_id(env_id, num_envs=3)
    env.set_seed(0)
    steps = ToolUseEnv(**kwargs).max_steps + 30
    td, tables, queries = rollout(env, steps, lambda td: torch.as_tensor(OraclePolicy.from_env(env)(td)))
    refs = replay(kwargs, td, tables, queries)
    done = td["next", "done"].squeeze(-1)
    assert td["next", "terminated"].squeeze(-1)[done].all() and td["next", "is_success"][done].all()
    assert len(refs) >= 2 * 3


@pytest.mark.parametrize("env_id", list(IDS))
def test_random_episodes_match_tool_use_env(env_id):
    kwargs = IDS[env_id]
    env = ToolUseBatchedEnv.from_id(env_id, num_envs=4)
    env.set_seed(1)
    generator = torch.Generator().manual_seed(1)
    max_steps = ToolUseEnv(**kwargs).max_steps
    choose = oracle_with_wasted_turns(env, generator)
    td, tables, queries = rollout(env, 2 * max_steps, choose)
    refs = replay(kwargs, td, tables, queries)
    assert len(refs) >= 8


# The hard id's budget holds 5 of its 6 lookups: a quota of 2 to reach the quota errors (and a
# shorter budget, which still holds 3 lookups, to keep the test short).
@pytest.mark.parametrize("env_id, overrides", [("MaskedRL/ToolUse-v0", {}),
                                               ("MaskedRL/ToolUseHard-v0", dict(max_calls=2, max_steps=160))])
def test_wasted_turns_quota_errors_and_truncation_match_tool_use_env(env_id, overrides):
    kwargs = {**IDS[env_id], **overrides}
    env = ToolUseBatchedEnv.from_id(env_id, num_envs=16, **overrides)
    env.set_seed(2)
    generator = torch.Generator().manual_seed(2)
    steps = 3 * ToolUseEnv(**kwargs).max_steps
    refs = []
    for weights in (None, call_heavy_weights(env.grammar)):
        td, tables, queries = rollout(env, steps, random_tokens(env, generator, weights))
        refs += replay(kwargs, td, tables, queries)
    g = env.grammar
    heads = response_heads(refs)
    keys = {g.token_name(g.key(k)) for k in range(g.n_keys)}
    assert any(h[0] == "RESULT" for h in heads)
    if g.call_prefix:
        assert any(h[:2] == ("ERROR", "CALL") and h[2] in keys for h in heads)  # over quota
        assert any(h[:2] == ("ERROR", "CALL") and h[2] not in keys for h in heads)  # CALL non-key
        assert any(h[0] == "ERROR" and h[1] in keys for h in heads)  # a key without CALL
    else:
        assert any(h[0] == "ERROR" and h[1] in keys for h in heads)  # over quota
        assert any(h[0] == "ERROR" and h[1] not in keys for h in heads)  # malformed turn
    episodes_over = [ref for ref in refs if ref._episode_over]
    truncated_in_block = [r for r in episodes_over if r._num_steps == r.max_steps and r._block_pos < len(r._block)]
    assert truncated_in_block and any(r._phase == 3 for r in episodes_over)  # 3: a closing block
    if env.max_calls >= g.n_queries:
        assert any(r._num_in_order == g.n_queries for r in refs)  # every in-order lookup bonus


def test_options_match_tool_use_env():
    """call_cost, no partial credit, a one-token closing block, n_filler > 1, max_calls, and a
    window (26) shorter than the oracle's episode (27 steps), so it scrolls."""
    kwargs = dict(n_keys=5, n_values=3, n_queries=3, response_len=5, closing_len=1, n_filler=3,
                  window=26, max_steps=60, max_calls=4, call_cost=0.03, lookup_reward=0.25,
                  partial_credit=False)
    env = ToolUseBatchedEnv(8, **kwargs)
    env.set_seed(3)
    generator = torch.Generator().manual_seed(3)
    refs = []
    for choose in (oracle_with_wasted_turns(env, generator, 0.15), random_tokens(env, generator)):
        td, tables, queries = rollout(env, 150, choose)
        refs += replay(kwargs, td, tables, queries)
    assert any(r._is_success for r in refs) and any(r._phase == 3 and not r._is_success for r in refs)


# -- TorchRL integration -------------------------------------------------------------------------


@pytest.mark.parametrize("env_id", list(IDS))
def test_check_env_specs(env_id):
    check_env_specs(ToolUseBatchedEnv.from_id(env_id, num_envs=2), seed=0)


def test_keys_dtypes_and_shapes_match_make_torchrl_env():
    batched = make_torchrl_env(num_envs=3, backend="batched", seed=0)
    assert isinstance(batched, ToolUseBatchedEnv)
    gym_env = make_torchrl_env(num_envs=3, seed=0)
    try:
        for spec in ("observation_spec", "full_done_spec", "full_reward_spec", "full_action_spec"):
            assert getattr(batched, spec) == getattr(gym_env, spec), spec
        a, b = batched.rollout(5, break_when_any_done=False), gym_env.rollout(5, break_when_any_done=False)
        assert set(a.keys(True, True)) == set(b.keys(True, True))
        for key in a.keys(True, True):
            assert (a[key].dtype, a[key].shape) == (b[key].dtype, b[key].shape), key
    finally:
        gym_env.close()


def test_partial_reset_and_final_observation():
    env = ToolUseBatchedEnv(3, max_steps=10)
    env.set_seed(0)
    value = torch.full((3,), env.grammar.value(0))  # malformed turns: every episode is truncated
    td = env.rollout(25, lambda td: td.set("action", value), break_when_any_done=False)
    truncated = td["next", "truncated"].squeeze(-1)
    assert truncated.sum() == 2 * 3 and not td["next", "terminated"].any()
    assert (td["next", "tokens"][truncated][:, -10:] != 0).all()  # the final window is kept
    assert (td["tokens"][:, 10] == 0).all() and (td["num_agent_tokens"][:, 10] == 0).all()

    # Reset one environment by hand: the others keep their state.
    env.reset()
    td = env.rand_step(env.reset())
    before = td["next"].exclude("done", "terminated", "truncated").clone()
    reset = torch.tensor([[False], [True], [False]])
    after = env.reset(td["next"].clone().set("_reset", reset))
    assert (after["tokens"][1] == 0).all() and after["loss_mask"][1].item() == 0
    assert torch.equal(after["tokens"][[0, 2]], before["tokens"][[0, 2]])


def test_rollout_waits_for_every_episode_to_end():
    """break_when_all_done: TorchRL's partial steps ("_step") hold the finished environments."""
    torch.manual_seed(0)  # the random actions: none may answer and end an episode early
    env = ToolUseBatchedEnv(2, max_steps=10)
    env.set_seed(0)
    env.reset()
    td0 = env.rand_step(env.reset())["next"]
    # Env 0 is 9 steps into its episode when env 1 starts its own.
    td0 = env.reset(td0.set("_reset", torch.tensor([[False], [True]])))
    td = env.rollout(30, tensordict=td0, auto_reset=False, break_when_any_done=False,
                     break_when_all_done=True)
    assert td.shape == (2, 10)
    assert td["next", "truncated"][0, 8] and td["next", "truncated"][1, 9]
    assert torch.equal(td["next", "tokens"][0, 9], td["next", "tokens"][0, 8])  # held


def test_seeding():
    def tokens(seed):
        torch.manual_seed(0)  # the random actions of env.rollout
        env = ToolUseBatchedEnv.from_id("MaskedRL/ToolUseHard-v0", num_envs=3)
        env.set_seed(seed)
        return env.rollout(200, break_when_any_done=False)["next", "tokens"]

    assert torch.equal(tokens(3), tokens(3)) and not torch.equal(tokens(3), tokens(4))


def test_task_draws_are_uniform():
    env = ToolUseBatchedEnv(6000, n_keys=3, n_values=3, n_queries=2, n_filler=4)
    env.set_seed(0)
    env.reset()
    # Tables: 3 values per key, each 1/3; queries: 6 ordered pairs of distinct keys, each 1/6.
    values = torch.bincount(env.table.reshape(-1), minlength=3) / env.table.numel()
    pairs = torch.bincount(env.queries[:, 0] * 3 + env.queries[:, 1], minlength=9) / 6000
    assert torch.allclose(values, torch.full((3,), 1 / 3), atol=0.015)
    assert torch.allclose(pairs[[1, 2, 3, 5, 6, 7]], torch.full((6,), 1 / 6), atol=0.015)
    assert pairs[[0, 4, 8]].sum() == 0
    # Filler words: a malformed turn, then [ERROR <pad> w ... w END] (rollout steps 4 to 19).
    td = env.rollout(3 + 1 + 16, lambda td: td.set("action", torch.zeros(6000, dtype=torch.int64)))
    written = td["next", "tokens"][..., -1]
    assert (written[:, 4] == ERROR).all() and (written[:, 5] == 0).all() and (written[:, 19] == END).all()
    words = td["next", "tokens"][:, 6:19, -1].reshape(-1) - env.grammar.filler(0)
    assert torch.allclose(torch.bincount(words, minlength=4) / words.numel(), torch.full((4,), 0.25),
                          atol=0.015)


def test_one_hot_actions_and_tokens_dtype():
    env = ToolUseBatchedEnv(2, categorical_action_encoding=False, tokens_dtype=torch.int32)
    check_env_specs(env, seed=0)
    oracle = OraclePolicy.from_env(env)

    def one_hot_oracle(td):
        action = torch.as_tensor(oracle(td.select("tokens", "loss_mask")))
        return td.set("action", torch.nn.functional.one_hot(action, env.grammar.vocab_size))

    td = env.rollout(50, one_hot_oracle)
    assert td["tokens"].dtype == torch.int32 and td["action"].shape == (2, 44, 17)
    embed = torch.nn.Embedding(17, 3)  # what the recipe's MLP encoder reads tokens with
    assert torch.equal(embed(td["tokens"]), embed(td["tokens"].long()))
    assert td["next", "terminated"][:, -1].all() and td["next", "is_success"][:, -1].all()


def test_collectors():
    from torchrl.collectors import Collector, MultiSyncCollector

    from masked_rl.policy import SkipMaskedSteps

    policy = SkipMaskedSteps(OraclePolicy.from_id("MaskedRL/ToolUse-v0").as_module())
    collector = Collector(ToolUseBatchedEnv(4), policy, frames_per_batch=4 * 50, total_frames=-1,
                          auto_register_policy_transforms=False)
    collector.set_seed(0)
    batch = next(iter(collector))
    collector.shutdown()
    assert batch.shape == (4, 50)
    done = batch["next", "done"].squeeze(-1)
    assert done.sum() == 4 and done[:, 43].all() and batch["next", "is_success"][done].all()
    assert (batch["tokens"][:, 44] == 0).all()  # every env restarted after its 44 steps
    assert (batch["next", "tokens"][:, 43, -44:] != 0).all()  # and kept its final window

    # One worker process (each costs seconds to start): the env is rebuilt there from its class.
    collector = MultiSyncCollector(
        [ToolUseBatchedEnv], policy, frames_per_batch=2 * 50, total_frames=2 * 50,
        create_env_kwargs=[{"num_envs": 2}], auto_register_policy_transforms=False,
    )
    try:
        batch = next(iter(collector))
    finally:
        collector.shutdown()
    done = batch["next", "done"].squeeze(-1)
    assert batch.numel() == 100 and done.sum() == 2 and batch["next", "is_success"][done].all()


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((0,), {}, ValueError, "num_envs must be an integer >= 1, got 0"),
        ((2,), dict(render_mode="ansi"), ValueError, "render_mode must be None"),
        ((2,), dict(tokens_dtype=torch.float32), ValueError, "tokens_dtype must be an integer"),
        ((2,), dict(n_keys=300, tokens_dtype=torch.int8), ValueError, "tokens_dtype must hold token ids up to 312, got torch.int8"),
        ((2,), dict(response_len=3), ValueError, "response_len must be an integer >= 4, got 3"),
    ],
)
def test_bad_arguments(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        ToolUseBatchedEnv(*args, **kwargs)


def test_bad_ids_and_backend_arguments():
    with pytest.raises(ValueError, match="env_id must name a ToolUseEnv"):
        ToolUseBatchedEnv.from_id("CartPole-v1", num_envs=2)
    with pytest.raises(ValueError, match=r"backend must be one of \('gym', 'batched'\), got 'jax'"):
        make_torchrl_env(backend="jax")
    with pytest.raises(ValueError, match="vectorization='async' applies to backend='gym' only"):
        make_torchrl_env(backend="batched", vectorization="async")


def test_bad_steps():
    env = ToolUseBatchedEnv(2, max_steps=4)
    td = env.reset()
    td["action"] = torch.tensor([99, -1])
    env.step(td)  # masked steps (the prompt): the action is ignored
    td = env.reset()
    for _ in range(3):
        td = env.step(td.set("action", torch.tensor([0, 0])))["next"]
    with pytest.raises(ValueError, match=r"action must be a token id in \[0, 17\) .* got \[17\] in environments \[1\]"):
        env.step(td.set("action", torch.tensor([0, 17])))
    for bad in (torch.tensor([0.0, 10.9]), torch.tensor([True, False])):
        with pytest.raises(ValueError, match=rf"action must be an integer tensor of token ids, got dtype {bad.dtype}"):
            env.step(td.clone().set("action", bad))
    td = env.step(td.set("action", torch.tensor([0, 0])))["next"]
    assert td["truncated"].all()
    with pytest.raises(RuntimeError, match=r"environments \[0, 1\] whose episode ended"):
        env.step(td.set("action", torch.tensor([0, 0])))


def test_episode_state_round_trip_continues_identically():
    from masked_rl_envs.tool_use_batched import ToolUseBatchedEnv

    a = ToolUseBatchedEnv(num_envs=3)
    a.set_seed(0)
    td = a.reset()
    g = torch.Generator().manual_seed(1)
    for _ in range(25):
        td["action"] = torch.randint(a.action_spec.space.n, (3,), generator=g)
        _, td = a.step_and_maybe_reset(td)
    saved, saved_td = a.episode_state(), td.clone()
    b = ToolUseBatchedEnv(num_envs=3)
    b.set_episode_state(saved)
    td_b = saved_td.clone()
    for _ in range(60):
        action = torch.randint(a.action_spec.space.n, (3,), generator=g)
        td["action"], td_b["action"] = action, action.clone()
        out_a, td = a.step_and_maybe_reset(td)
        out_b, td_b = b.step_and_maybe_reset(td_b)
        assert (out_a == out_b).all()
    with pytest.raises(ValueError, match="must have shape"):
        ToolUseBatchedEnv(num_envs=2).set_episode_state(saved)


def test_collector_seeded_after_construction_is_deterministic():
    """A collector resets its environment when built; set_seed() afterwards must still decide
    every episode (as with gymnasium's reset(seed=...))."""
    from torchrl.collectors import Collector
    from torchrl.envs.utils import RandomPolicy

    from masked_rl_envs.tool_use_batched import ToolUseBatchedEnv

    batches = []
    for _ in range(2):
        env = ToolUseBatchedEnv(num_envs=4)
        torch.manual_seed(0)
        collector = Collector(env, RandomPolicy(env.action_spec), frames_per_batch=200, total_frames=200)
        collector.set_seed(7)
        batches.append(next(iter(collector)))
        collector.shutdown()
    assert torch.equal(batches[0]["next", "tokens"], batches[1]["next", "tokens"])
