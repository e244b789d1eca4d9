"""Masked GAE under context parallelism: every rank holds a slice of every row.

Run on one machine with two CPU processes (gloo)::

    torchrun --nproc-per-node 2 examples/context_parallel.py
    torchrun --nproc-per-node 4 examples/context_parallel.py --layout contiguous --steps 1001

Each rank builds the same seeded batch of agentic rows (a masked prompt, agent turns, masked tool
outputs, a terminal reward on a masked step) as a TorchRL ``TensorDict``, keeps only its slice
(``cp_shard``: Megatron's zigzag layout by default), and runs ``MaskedGAE(cp_group=...)`` on that
slice: one small ``all_gather`` per call. The script then gathers the full rows (for the check
only) and compares them with the single-process estimator.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from tensordict import TensorDict

from masked_rl import MaskedGAE
from masked_rl.distributed import cp_all_gather, cp_chunk_lengths, cp_shard


def agentic_rows(batch: int, steps: int, seed: int = 0) -> TensorDict:
    """A ``[B, T]`` rollout: prompt (masked), then agent turns and tool outputs (masked)
    alternating, a terminal reward on the last (masked) step. The same on every rank (seeded)."""
    g = torch.Generator().manual_seed(seed)
    turn = (torch.arange(steps) // 24 + torch.randint(0, 2, (batch, 1), generator=g)) % 2 == 1
    value = torch.randn(batch, steps + 1, 1, generator=g, dtype=torch.float64)  # critic outputs
    reward = torch.zeros(batch, steps, 1, dtype=torch.float64)
    reward[:, -1] = 1.0
    done = torch.zeros(batch, steps, 1, dtype=torch.bool)
    done[:, -1] = True
    return TensorDict({
        "loss_mask": turn & (torch.arange(steps) >= 16),  # a prompt of 16 steps
        "state_value": value[:, :-1],
        "next": {"reward": reward, "done": done, "terminated": done, "state_value": value[:, 1:]},
    }, batch_size=[batch, steps])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, cp = dist.get_rank(), dist.get_world_size()
    full = agentic_rows(args.batch, args.steps)
    # Rows whose length P = cp (or 2 * cp) does not divide are cut unevenly: every rank passes
    # the same chunk lengths (the default cut of cp_shard).
    lengths = cp_chunk_lengths(args.steps, cp, args.layout)
    local = cp_shard(full, rank, cp, layout=args.layout, time_dim=1, chunk_lengths=lengths)

    # The one change for context parallelism: cp_group (and the layout).
    gae = MaskedGAE(gamma=0.99, lmbda=0.95, value_network=None, cp_group=dist.group.WORLD,
                    cp_layout=args.layout, cp_chunk_lengths=lengths)
    gae(local)  # writes this rank's slice of "advantage" and "value_target"

    # For the check only: gather full rows (O(T) traffic, which the estimator never needs).
    gathered = cp_all_gather(local["advantage"], layout=args.layout, chunk_lengths=lengths)
    expected = MaskedGAE(gamma=0.99, lmbda=0.95, value_network=None)(full)["advantage"]
    error = (gathered - expected).abs().max().item()
    held = local.shape[1]
    per_rank = 2 if args.layout == "zigzag" else 1
    summaries = 10 * args.batch * per_rank  # numbers (float64 here); up to 640 travel with the header
    sent = f"one all_gather of {660 * 8} bytes" if summaries <= 640 else \
        f"two all_gathers of {20 * 8} and {summaries * 8} bytes"
    print(f"rank {rank}/{cp}: {held} of {args.steps} steps per row, {sent}; "
          f"max |error| vs single process {error:.1e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
