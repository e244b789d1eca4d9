"""Masked GAE under context parallelism: every rank holds a slice of every row.

Run on one machine with two CPU processes (gloo)::

    torchrun --nproc-per-node 2 examples/context_parallel.py
    torchrun --nproc-per-node 4 examples/context_parallel.py --layout contiguous --steps 1001

Each rank builds the same seeded batch of agentic rows (a masked prompt, agent turns, masked tool
outputs, a terminal reward on a masked step), keeps only its slice (``cp_shard``: Megatron's
zigzag layout by default), and estimates advantages on that slice with one small ``all_gather``.
The script then gathers the full rows (for the check only) and compares them with the
single-process estimator.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from masked_rl import masked_generalized_advantage_estimate
from masked_rl.distributed import (
    cp_all_gather,
    cp_chunk_lengths,
    cp_masked_generalized_advantage_estimate,
    cp_shard,
)


def agentic_rows(batch: int, steps: int, seed: int = 0):
    """``[B, T, 1]`` rows: prompt (masked), then agent turns and tool outputs (masked) alternating,
    a terminal reward on the last (masked) step. The same on every rank (seeded)."""
    g = torch.Generator().manual_seed(seed)
    turn = (torch.arange(steps) // 24 + torch.randint(0, 2, (batch, 1), generator=g)) % 2 == 1
    loss_mask = turn & (torch.arange(steps) >= 16)  # [B, T], prompt of 16 steps
    value = torch.randn(batch, steps + 1, 1, generator=g, dtype=torch.float64)
    reward = torch.zeros(batch, steps, 1, dtype=torch.float64)
    reward[:, -1] = 1.0
    done = torch.zeros(batch, steps, 1, dtype=torch.bool)
    done[:, -1] = True
    return value[:, :-1], value[:, 1:], reward, done, done.clone(), loss_mask


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
    local = [cp_shard(x, rank, cp, layout=args.layout, time_dim=1, chunk_lengths=lengths) for x in full]

    with torch.no_grad():
        advantage, value_target = cp_masked_generalized_advantage_estimate(
            0.99, 0.95, *local, layout=args.layout, chunk_lengths=lengths
        )

    # For the check only: gather full rows (O(T) traffic, which the estimator never needs).
    gathered = cp_all_gather(advantage, layout=args.layout, chunk_lengths=lengths)
    expected = masked_generalized_advantage_estimate(0.99, 0.95, *full)[0]
    error = (gathered - expected).abs().max().item()
    held = local[0].shape[1]
    per_rank = 2 if args.layout == "zigzag" else 1
    sent = (10 * args.batch + 1) * per_rank * 8
    print(f"rank {rank}/{cp}: {held} of {args.steps} steps per row, one all_gather of {sent} bytes; "
          f"max |error| vs single process {error:.1e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
