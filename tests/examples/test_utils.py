"""The recipe's helpers: cut statistics against a plain loop, atomic files, interruption."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from tensordict import TensorDict

from masked_rl_examples.ppo_tool_use import utils


def batch_of(done, terminated, next_loss_mask) -> TensorDict:
    done = torch.as_tensor(done, dtype=torch.bool)
    return TensorDict({"next": {
        "done": done.unsqueeze(-1),
        "terminated": torch.as_tensor(terminated, dtype=torch.bool).unsqueeze(-1),
        "loss_mask": torch.as_tensor(next_loss_mask, dtype=torch.int8).unsqueeze(-1),
    }}, batch_size=done.shape)


def reference_cut_statistics(done, terminated, next_loss_mask) -> dict:
    """Row by row, step by step: count episodes, cut episodes, bootstrap reads, masked reads."""
    episodes = cuts = reads = masked_reads = 0
    for row_done, row_terminated, row_mask in zip(done, terminated, next_loss_mask):
        for t, (d, k, m) in enumerate(zip(row_done, row_terminated, row_mask)):
            last = t == len(row_done) - 1
            if d or last:
                episodes += 1
            if last and not d:
                cuts += 1
            if (d and not k) or (last and not d):
                reads += 1
                masked_reads += m == 0
    stats = {"episodes_cut_share": cuts / episodes}
    if reads:
        stats["bootstrap_masked_share"] = masked_reads / reads
    return stats


def test_cut_statistics_worked_case():
    # Row 0: an episode ends (terminated) at step 1, the next one is cut by the batch end, on
    # an observation where the agent acts. Row 1: a truncation at step 2 (its final
    # observation is masked), a one-step episode that terminates at the batch end.
    done = [[0, 1, 0, 0], [0, 0, 1, 1]]
    terminated = [[0, 1, 0, 0], [0, 0, 0, 1]]
    next_loss_mask = [[0, 0, 0, 1], [1, 1, 0, 0]]
    stats = utils.cut_statistics(batch_of(done, terminated, next_loss_mask))
    assert stats == pytest.approx({"episodes_cut_share": 1 / 4, "bootstrap_masked_share": 1 / 2})
    # Truncations turned into terminations (--no-bootstrap-truncated): only the cut is read.
    stats = utils.cut_statistics(batch_of(done, done, next_loss_mask))
    assert stats == pytest.approx({"episodes_cut_share": 1 / 4, "bootstrap_masked_share": 0.0})
    # No bootstrap read at all: no masked share to report.
    assert utils.cut_statistics(batch_of([[0, 1]], [[0, 1]], [[1, 0]])) == {
        "episodes_cut_share": 0.0}


@pytest.mark.parametrize("shape", [(4, 9), (2, 3, 5), (1, 1)])
@pytest.mark.parametrize("seed", range(5))
def test_cut_statistics_match_a_plain_loop(shape, seed):
    generator = torch.Generator().manual_seed(seed)
    done = torch.rand(shape, generator=generator) < 0.3
    terminated = done & (torch.rand(shape, generator=generator) < 0.5)
    next_loss_mask = (torch.rand(shape, generator=generator) < 0.3).to(torch.int8)
    rows = lambda x: x.reshape(-1, shape[-1]).tolist()  # noqa: E731
    expected = reference_cut_statistics(rows(done), rows(terminated), rows(next_loss_mask))
    stats = utils.cut_statistics(batch_of(done, terminated, next_loss_mask))
    assert stats == pytest.approx(expected)


def test_save_atomically_keeps_the_previous_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    utils.save_atomically({"weights": torch.ones(3)}, path)

    def save_half_then_fail(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", save_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        utils.save_atomically({"weights": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert torch.equal(torch.load(path, weights_only=True)["weights"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]  # no temporary left
    utils.write_text_atomically("new", tmp_path / "summary.json")
    assert (tmp_path / "summary.json").read_text() == "new"


def test_truncate_csv_scalars(tmp_path):
    scalars = tmp_path / "scalars" / "train"
    scalars.mkdir(parents=True)
    (scalars / "loss.csv").write_text("512,1.0\n1024,2.0\n1536,3.0\n")
    utils.truncate_csv_scalars(tmp_path, 1024)
    assert (scalars / "loss.csv").read_text() == "512,1.0\n1024,2.0\n"


def test_stop_on_interrupt_turns_sigint_into_a_flag():
    before = signal.getsignal(signal.SIGINT)
    with utils.StopOnInterrupt() as interrupt:
        assert not interrupt.requested
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # a second one changes nothing
        assert interrupt.requested
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("handler", [lambda signum, frame: None, signal.SIG_DFL],
                         ids=["python-handler", "SIG_DFL"])
def test_processes_started_under_sigint_ignored_ignore_it(handler):
    """Whatever SIGINT handler the suite runs under (nohup and background jobs start it
    ignored), the block ignores SIGINT in its children and restores the handler it found."""
    code = "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"
    suite_handler = signal.signal(signal.SIGINT, handler)  # not ignored: the block must ignore it
    try:
        with utils.sigint_ignored():
            child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                   check=True)
        assert child.stdout.strip() == "True"
        assert signal.getsignal(signal.SIGINT) is handler
    finally:
        signal.signal(signal.SIGINT, suite_handler)


def test_evaluate_runs_the_actor_on_agent_steps_only_with_the_same_greedy_episodes():
    from torchrl.envs.utils import ExplorationType, set_exploration_type

    torch.manual_seed(0)
    env = utils.make_env("MaskedRL/ToolUse-v0", 16)
    actor, _ = utils.make_actor_critic(env, 8, 32, 1)
    rows = []
    actor.register_forward_pre_hook(lambda module, args: rows.append(args[0].batch_size.numel()))
    result = utils.evaluate(actor, env, seed=3, max_steps=80)
    agent_rows = sum(rows)
    # The reference: the same seeded tasks, the unwrapped actor on every step.
    env.set_seed(3)
    rows.clear()
    with torch.no_grad(), set_exploration_type(ExplorationType.DETERMINISTIC):
        rollout = env.rollout(80, actor, break_when_any_done=False)
    assert sum(rows) == 16 * 80  # every env, every step
    trainable = rollout["loss_mask"].squeeze(-1).bool()
    # (+ 1: one row once, for the output shapes, while no step is the agent's yet)
    assert 0 < agent_rows <= int(trainable.sum()) + 1 < 16 * 80 // 4
    done = rollout["next", "done"].squeeze(-1)
    first_end = done.int().argmax(-1)
    expected = rollout["next", "is_success"][torch.arange(16), first_end].float().mean().item()
    assert result["success_rate"] == expected
    assert result["episode_length"] == (first_end + 1).float().mean().item()


def test_evaluate_counts_90_of_100_as_the_90_percent_threshold(monkeypatch):
    class FixedRollout:
        """100 one-step episodes, 90 of them successful."""

        def set_seed(self, seed):
            pass

        def rollout(self, max_steps, policy, break_when_any_done):
            success = torch.arange(100) < 90
            return TensorDict({"next": {"done": torch.ones(100, 1, 1, dtype=torch.bool),
                                        "reward": success.float().view(100, 1, 1),
                                        "is_success": success.view(100, 1)}}, batch_size=[100, 1])

    from tensordict.nn import TensorDictModule

    actor = TensorDictModule(torch.nn.Identity(), in_keys=["tokens"], out_keys=["action"])
    result = utils.evaluate(actor, FixedRollout(), seed=0, max_steps=1)
    assert result["success_rate"] >= 0.9 and result["success_rate"] == 0.9


def test_legend_only_where_something_is_labelled(recwarn):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (empty, labelled) = plt.subplots(1, 2)
    empty.plot([0, 1], [0, 1])  # no label
    labelled.plot([0, 1], [1, 0], label="masked")
    utils.legend(empty, loc="upper left")
    utils.legend(labelled, loc="upper left")
    plt.close(fig)
    assert empty.get_legend() is None and labelled.get_legend() is not None
    assert not [w for w in recwarn if "legend" in str(w.message)]
