"""TokenPPOLoss under data parallelism: a 2-rank gloo DDP step has the single-process gradient.

Two ranks hold batches of different sizes with very different trainable-token counts (one row
without any). The loss module itself is wrapped in ``DistributedDataParallel`` (policy, critic
trunk and value head are its parameters), each rank backpropagates its own batch, and DDP
averages the gradients. With ``dp_group`` the result must equal one process's gradient on the
concatenated batch, for ``"token_mean"`` and ``"sequence_mean"``, with and without
``normalize_advantage``; without ``dp_group`` (the mean of per-rank means) it must not.
"""

from __future__ import annotations

import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed_worker import spawn_world
from tensordict import TensorDict

from masked_rl.llm import TokenCritic, TokenPPOLoss, TokenValueHead, token_log_probs

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with the gloo backend",
)

WORLD = 2
T = 9
ROWS = (2, 5)  # rank 0 holds 2 rows, rank 1 holds 5
SETTINGS = [(reduction, normalize, shared) for reduction in ("token_mean", "sequence_mean")
            for normalize in (False, True) for shared in (False, True)]


def _models(shared: bool):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    config = LlamaConfig(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, pad_token_id=0)
    torch.manual_seed(0)
    policy = LlamaForCausalLM(config).double().eval()
    trunk = policy.model if shared else LlamaModel(config).double().eval()
    critic = TokenCritic(trunk, TokenValueHead(16, zero_init=False)).double()
    return policy, critic


def _batches():
    """Both ranks' batches, left-padded to one ``T``; rank 1's mask is dense, rank 0's sparse."""
    g = torch.Generator().manual_seed(7)
    out = []
    for rank, rows in enumerate(ROWS):
        lengths = torch.randint(4, T + 1, (rows,), generator=g)
        attention = torch.arange(T).expand(rows, T) >= (T - lengths)[:, None]
        tokens = torch.where(attention, torch.randint(1, 12, (rows, T), generator=g), 0)
        first = attention & ~torch.cat([torch.zeros(rows, 1, dtype=torch.bool), attention[:, :-1]], 1)
        keep = 0.15 if rank == 0 else 0.9
        loss_mask = attention & ~first & (torch.rand(rows, T, generator=g) < keep)
        loss_mask[0] = False  # a row without a trainable token
        loss_mask[-1, -1] = True
        out.append(dict(tokens=tokens, attention=attention, loss_mask=loss_mask,
                        advantage=torch.randn(rows, T, 1, generator=g, dtype=torch.float64),
                        value_target=torch.randn(rows, T, 1, generator=g, dtype=torch.float64)))
    return out


def _data(policy, parts) -> TensorDict:
    tokens, attention = parts["tokens"], parts["attention"]
    with torch.no_grad():
        old = token_log_probs(policy, tokens, attention).double()
        for p in policy.parameters():  # the policy has moved since scoring: ratios differ from 1
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3),
                                      dtype=p.dtype))
    return TensorDict({"tokens": {"full": tokens}, "masks": {"all_attention_mask": attention},
                       "log_probs": {"full": old - 0.1 * parts["advantage"].squeeze(-1)},
                       "loss_mask": parts["loss_mask"], "advantage": parts["advantage"],
                       "value_target": parts["value_target"]}, batch_size=[tokens.shape[0]])


def _loss(shared, reduction, normalize, dp_group=None):
    policy, critic = _models(shared)
    return policy, TokenPPOLoss(policy, critic, reduction=reduction, normalize_advantage=normalize,
                                entropy_coeff=0.01, dp_group=dp_group)


def _total(out):
    return out["loss_objective"] + out["loss_critic"] + out["loss_entropy"]


def _rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    grads = {}
    for reduction, normalize, shared in SETTINGS:
        for grouped in (True, False):
            policy, loss = _loss(shared, reduction, normalize,
                                 dist.group.WORLD if grouped else None)
            data = _data(policy, _batches()[rank])
            ddp = DistributedDataParallel(loss)
            _total(ddp(data)).backward()
            grads[reduction, normalize, shared, grouped] = {
                n: p.grad.clone() for n, p in loss.named_parameters() if p.grad is not None}
    torch.save(grads, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    with tempfile.TemporaryDirectory() as tmp:
        spawn_world(_rank, WORLD, tmp)
        return [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(WORLD)]


def _single(reduction, normalize, shared):
    policy, loss = _loss(shared, reduction, normalize)
    parts = _batches()
    data = torch.cat([_data(_models(shared)[0], p) for p in parts])
    # the same moved policy as the ranks': _data moved a fresh copy; move this one identically
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3),
                                      dtype=p.dtype))
    _total(loss(data)).backward()
    return {n: p.grad for n, p in loss.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("reduction", "normalize", "shared"), SETTINGS)
def test_ddp_step_with_dp_group_is_the_single_process_gradient(ranks, reduction, normalize, shared):
    expected = _single(reduction, normalize, shared)
    for rank in range(WORLD):
        got = ranks[rank][reduction, normalize, shared, True]
        assert got.keys() == expected.keys() and len(got) > 4
        for name, grad in got.items():
            torch.testing.assert_close(grad, expected[name], atol=1e-10, rtol=1e-8, msg=name)


@pytest.mark.parametrize(("reduction", "normalize", "shared"), SETTINGS)
def test_without_dp_group_the_split_changes_the_gradient(ranks, reduction, normalize, shared):
    expected = _single(reduction, normalize, shared)
    got = ranks[0][reduction, normalize, shared, False]
    worst = max((got[n] - expected[n]).abs().max().item() for n in expected)
    assert worst > 1e-4, "the per-rank mean matched the global one: the test cannot bite"


def test_dp_group_without_a_process_group_says_so():
    policy, loss = _loss(False, "token_mean", False, object())  # no process group initialised
    data = _data(policy, _batches()[0])
    with pytest.raises((RuntimeError, ValueError), match="process group|init_process_group"):
        loss(data)
