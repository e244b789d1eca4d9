"""The chat tool-use environment's rules, played through TorchRL's ChatEnv step by step."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tensordict import lazy_stack
from torchrl.data.llm import History

from masked_rl_envs.chat_tool_use import ChatToolUseConfig, make_chat_tool_use_env
from masked_rl_envs.llm_factories import make_tokenizer


def _step(env, td, texts):
    """One assistant turn per row (the policy's output in history mode), then env.step."""
    turns = lazy_stack([History(role="assistant", content=t).unsqueeze(0) for t in texts])
    td["history"].full = td["history"].prompt.extend(turns, inplace=False, dim=-1)
    td = env.step(td)
    return td, td["next"]


def _flat(td, key):
    return td[key].reshape(-1).tolist()


def _oracle_turns(env, row):
    """The perfect episode for one row, read from the transform's hidden state."""
    tr = env.transform
    keys = [f"k{k}" for k in tr.queries[row]]
    values = [f"v{tr.tables[row, k]}" for k in tr.queries[row]]
    return [f"lookup {k}" for k in keys] + ["answer " + " ".join(values)]


def test_oracle_episode_rewards_messages_and_termination():
    cfg = ChatToolUseConfig(response_len=6)
    env = make_chat_tool_use_env(3, cfg, seed=1)
    td = env.reset()
    plans = [_oracle_turns(env, i) for i in range(3)]
    tr = env.transform
    assert [list(td["history"].prompt[i].content) for i in range(3)] == [
        [" ".join(f"k{k}" for k in tr.queries[i])] for i in range(3)
    ]
    rewards, dones = [], []
    for turn in range(3):
        td, nxt = _step(env, td, [plans[i][turn] for i in range(3)])
        rewards.append(_flat(nxt, "reward"))
        dones.append(_flat(nxt, "done"))
        if turn < 2:
            for i in range(3):
                key = tr.queries[i, turn]
                msg = nxt["history"].prompt[i, -1]
                assert msg.role == "tool"
                content = msg.content.split()
                assert content[:2] == [f"k{key}", f"v{tr.tables[i, key]}"]
                assert len(content) == cfg.response_len and set(content[2:]) == {"w0"}
        td = nxt
    assert rewards == [[pytest.approx(0.1)] * 3, [pytest.approx(0.1)] * 3, [1.0] * 3]
    assert dones == [[False] * 3, [False] * 3, [True] * 3]
    assert _flat(nxt, "terminated") == [True] * 3 and _flat(nxt, "truncated") == [False] * 3
    assert _flat(nxt, "success") == [True] * 3
    assert _flat(nxt, "num_tool_calls") == [2] * 3
    # the answer gets no tool message: the transcript ends on the assistant's turn
    assert nxt["history"].prompt[0, -1].role == "assistant"


def test_lookup_bonus_only_in_the_order_asked_and_once():
    env = make_chat_tool_use_env(1, ChatToolUseConfig(max_calls=8), seed=3)
    td = env.reset()
    q0, q1 = (f"k{k}" for k in env.transform.queries[0])
    other = next(f"k{k}" for k in range(4) if f"k{k}" not in (q0, q1))
    got = []
    for text in (f"lookup {q1}", f"lookup {other}", f"lookup {q0}", f"lookup {q0}", f"lookup {q1}"):
        td, nxt = _step(env, td, [text])
        got.append(_flat(nxt, "reward")[0])
        td = nxt
    # q1 before q0 earns nothing, q0 earns the bonus once; the 5th turn truncates unserved
    assert got == [0.0, 0.0, pytest.approx(0.1), 0.0, 0.0]
    assert _flat(nxt, "truncated") == [True] and _flat(nxt, "terminated") == [False]
    assert _flat(nxt, "done") == [True] and _flat(nxt, "success") == [False]
    assert nxt["history"].prompt[0, -1].role == "assistant"  # truncated: no reply


@pytest.mark.parametrize("partial_credit, expected", [(True, 0.5), (False, 0.0)])
def test_answer_credit(partial_credit, expected):
    env = make_chat_tool_use_env(1, ChatToolUseConfig(partial_credit=partial_credit), seed=0)
    td = env.reset()
    tr = env.transform
    v0 = tr.tables[0, tr.queries[0, 0]]
    v1 = tr.tables[0, tr.queries[0, 1]]
    wrong = (v1 + 1) % 4
    _, nxt = _step(env, td, [f"answer v{v0} v{wrong} w0 k1"])  # words after the values: ignored
    assert _flat(nxt, "reward") == [expected]
    assert _flat(nxt, "terminated") == [True] and _flat(nxt, "success") == [False]


def test_missing_answer_values_are_wrong_and_extra_turn_words_are_ignored():
    env = make_chat_tool_use_env(2, seed=5)
    td = env.reset()
    tr = env.transform
    v0 = tr.tables[0, tr.queries[0, 0]]
    q1 = tr.queries[1, 0]
    td, nxt = _step(env, td, [f"answer v{v0}", f"lookup k{q1} answer v0 v0"])
    assert _flat(nxt, "reward") == [0.5, pytest.approx(0.1)]
    assert _flat(nxt, "done") == [True, False]
    assert nxt["history"].prompt[1, -1].content.split()[:2] == [f"k{q1}", f"v{tr.tables[1, q1]}"]


def test_malformed_turns_errors_call_cost_and_quota():
    cfg = ChatToolUseConfig(max_calls=1, call_cost=0.25, lookup_reward=0.0, max_turns=4,
                            response_len=4)
    env = make_chat_tool_use_env(1, cfg, seed=0)
    td = env.reset()
    replies, rewards = [], []
    for text in ("hello", "lookup k9", "lookup k1", "lookup k1"):
        td, nxt = _step(env, td, [text])
        replies.append(nxt["history"].prompt[0, -1].content.split())
        rewards.append(_flat(nxt, "reward")[0])
        td = nxt
    assert replies[0] == ["error", "w0", "w0", "w0"]
    assert replies[1] == ["error", "w0", "w0", "w0"]  # not a key of the table
    assert replies[2][0] == "k1"  # the one lookup of the quota
    assert rewards[:3] == [-0.25, -0.25, -0.25]
    # the 4th turn is beyond the quota, and the last of the budget: truncated, no reply
    assert rewards[3] == 0.0 and replies[3] == ["lookup", "k1"]
    assert _flat(nxt, "num_tool_calls") == [3]


def test_in_order_bonus_on_the_second_lookup():
    env = make_chat_tool_use_env(1, ChatToolUseConfig(lookup_reward=0.3), seed=4)
    td = env.reset()
    q0, q1 = (f"k{k}" for k in env.transform.queries[0])
    got = []
    for text in (f"lookup {q0}", f"lookup {q0}", f"lookup {q1}"):
        td, nxt = _step(env, td, [text])
        got.append(_flat(nxt, "reward")[0])
        td = nxt
    assert got == [pytest.approx(0.3), 0.0, pytest.approx(0.3)]


def test_finished_rows_stay_done_without_messages_or_reward():
    env = make_chat_tool_use_env(2, seed=0)
    td = env.reset()
    td, nxt = _step(env, td, ["answer v0 v0", "lookup k0"])
    td, nxt = _step(env, nxt, ["lookup k0", "lookup k1"])
    assert _flat(nxt, "done") == [True, False]
    assert _flat(nxt, "reward")[0] == 0.0
    # the finished row's later turn is appended by ChatEnv, but the tool answers nothing (rows
    # are padded to one length with TorchRL's "<none>" placeholder messages)
    roles = [r for r in nxt["history"].prompt[0].role if r != "<none>"]
    assert roles == ["user", "assistant", "assistant"]
    assert [r for r in nxt["history"].prompt[1].role if r != "<none>"] == [
        "user", "assistant", "tool", "assistant", "tool"]


def test_seeded_episodes():
    def tables(seed):
        env = make_chat_tool_use_env(4, seed=seed)
        env.reset()
        first = (env.transform.tables.copy(), env.transform.queries.copy())
        env.reset()
        return first, (env.transform.tables.copy(), env.transform.queries.copy())

    a, b, c = tables(0), tables(0), tables(1)
    assert all((x == y).all() for x, y in zip(a[0] + a[1], b[0] + b[1]))
    assert not all((x == y).all() for x, y in zip(a[0], c[0]))
    assert not all((x == y).all() for x, y in zip(a[0], a[1]))  # each reset draws new episodes


def test_transcript_tokens_and_assistant_mask():
    """The oracle transcript through the factory tokenizer: the mask is the assistant content."""
    tok = make_tokenizer(n_keys=4, n_values=4, n_filler=1)
    env = make_chat_tool_use_env(1, ChatToolUseConfig(response_len=3), tokenizer=tok, seed=2)
    td = env.reset()
    for text in _oracle_turns(env, 0):
        td, td = _step(env, td, [text])
    out = td["history"].prompt.apply_chat_template(
        tokenizer=tok, chat_template_name="chatml_format", add_generation_prompt=False,
        return_assistant_tokens_mask=True,
    )
    ids = out["input_ids"][0]
    mask = out["assistant_masks"][0].bool()
    assert tok.unk_token_id not in ids.tolist()
    masked_words = [t.lstrip("\u2581") for t in tok.convert_ids_to_tokens(ids[mask].tolist())]
    assert masked_words == " ".join(_oracle_turns(env, 0)).split()


def test_config_and_argument_errors():
    with pytest.raises(ValueError, match="n_queries must be <= n_keys=2"):
        ChatToolUseConfig(n_keys=2, n_queries=3)
    with pytest.raises(ValueError, match="response_len must be an integer >= 2, got 1"):
        ChatToolUseConfig(response_len=1)
    with pytest.raises(ValueError, match="lookup_reward must be a finite float >= 0"):
        ChatToolUseConfig(lookup_reward=float("nan"))
    with pytest.raises(ValueError, match="max_calls must be None or an integer >= 0"):
        ChatToolUseConfig(max_calls=-1)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        make_chat_tool_use_env(0)
    with pytest.raises(ValueError, match=r"tokenizer lacks the task words \['k2', 'k3'"):
        make_chat_tool_use_env(1, tokenizer=make_tokenizer(n_keys=2))
    from tensordict import TensorDict
    from torchrl.modules.llm.policies import ChatHistory

    env = make_chat_tool_use_env(1)
    full = History.from_chats([[{"role": "assistant", "content": "x"}]])
    with pytest.raises(RuntimeError, match="call env.reset"):
        env.step(TensorDict({"history": ChatHistory(full=full, batch_size=[1])}, batch_size=[1]))


def test_importing_the_packages_does_not_import_transformers():
    code = (
        "import sys, masked_rl, masked_rl_envs; "
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_groups_share_a_task_and_the_generator_state_resumes_the_stream():
    env = make_chat_tool_use_env(6, seed=7, group_size=3)
    env.reset()
    tr = env.transform
    for rows in (slice(0, 3), slice(3, 6)):
        assert (tr.tables[rows] == tr.tables[rows][:1]).all()
        assert (tr.queries[rows] == tr.queries[rows][:1]).all()
    assert not ((tr.tables[0] == tr.tables[3]).all() and (tr.queries[0] == tr.queries[3]).all())
    state = tr.generator_state()
    env.reset()
    expected = tr.tables.copy()
    other = make_chat_tool_use_env(6, seed=123, group_size=3)
    other.transform.set_generator_state(state)
    other.reset()
    assert (other.transform.tables == expected).all()
    with pytest.raises(ValueError, match="group_size must be a positive divisor of batch_size=6"):
        make_chat_tool_use_env(6, group_size=4)
