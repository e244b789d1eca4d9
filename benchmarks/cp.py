"""``masked-rl bench-cp``: context-parallel masked GAE against rebuilding full rows.

Run ``masked-rl bench-cp`` (or ``python -m masked_rl_benchmarks.cp``); ``--help`` lists the
options. For every ``--cp N`` it starts ``N`` gloo processes on this machine (one intra-op
thread each), shards the agentic workload of ``masked-rl bench`` (:func:`make_workload`) with
``--layout`` over them, and times, per shape:

``masked_rl_cp``
    :func:`masked_rl.distributed.cp_masked_generalized_advantage_estimate` on each rank's slice:
    one ``all_gather`` of a 20-number header and the summaries (``10 * B`` numbers per chunk),
    in one collective up to 64 rows x chunks, two beyond.
``rebuild_per_sample``
    The reference system's approach: per sample and per float tensor (``V``, ``V'``, ``r``) a
    zero-padded full-length row holding the rank's steps, summed over ranks with ``all_reduce``
    (``3 * B`` collectives), then the single-process function on the full rows and the rank's
    steps sliced out. Masks and episode flags are taken as already replicated on every rank
    (not sent, not timed): that favours it.
``rebuild_one_call``
    The same, with all rows and tensors in one buffer and one ``all_reduce``: the fewest
    collectives a rebuild can make, with the same ``O(B * T)`` bytes.

Before timing, every rank checks that the three agree. A round runs each implementation once
(between barriers, in an order shuffled identically on every rank); a call's time is the
slowest rank's, and the table shows the median over rounds, of the wall time and of the
process CPU time (all threads; less sensitive to other load on the machine). Bytes are what each rank hands to
collectives per call (counted by wrapping ``torch.distributed``): gloo's ring ``all_reduce``
then moves about ``2 * (N - 1) / N`` times that per rank, ``all_gather`` ``N - 1`` times.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from masked_rl.distributed import (
    cp_chunk_lengths,
    cp_masked_generalized_advantage_estimate,
    cp_shard,
)
from masked_rl.functional import masked_generalized_advantage_estimate
from masked_rl_benchmarks.bench import make_workload
from masked_rl_benchmarks.options import parse_cp_args

__all__ = ["count_collectives", "rebuild_gae", "main", "run"]

IMPLEMENTATIONS = ("masked_rl_cp", "rebuild_per_sample", "rebuild_one_call")
_COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_reduce",
                "broadcast", "send", "recv", "isend", "irecv", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter",
                "reduce", "batch_isend_irecv")


@contextlib.contextmanager
def count_collectives() -> Iterator[list[tuple[str, int]]]:
    """Record ``(name, bytes this rank sends in)`` for every ``torch.distributed`` collective.

    The bytes are those of the tensor the rank contributes (an ``all_gather``'s input, an
    ``all_reduce``'s buffer). ``barrier`` is not counted.
    """
    import masked_rl.distributed as cp_module

    calls: list[tuple[str, int]] = []

    def counting(name: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
            gather = name in ("all_gather_single", "all_gather_into_tensor")
            sent = (tensors[-1] if gather else tensors[0]) if tensors else None
            calls.append((name, 0 if sent is None else sent.numel() * sent.element_size()))
            return fn(*args, **kwargs)
        return wrapper

    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    bound = cp_module._all_gather_single  # bound at import: patched separately
    try:
        for name, fn in originals.items():
            setattr(dist, name, counting(name, fn))
        cp_module._all_gather_single = counting("all_gather_single", bound)
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        cp_module._all_gather_single = bound


def rebuild_gae(gamma, lmbda, local: list[Tensor], replicated: list[Tensor], positions: Tensor,
                horizon: int, group=None, *, per_sample: bool = True) -> tuple[Tensor, Tensor]:
    """The rebuild approach: full rows by zero-padded ``all_reduce``, full GAE, the rank's slice.

    ``local`` holds the rank's ``V, V', r`` slices ``[B, T_local, 1]``; ``replicated`` the full
    ``done, terminated, loss_mask`` (assumed present on every rank); ``positions`` the rank's
    time steps in the full row, in local order.
    """
    batch = local[0].shape[0]
    full = local[0].new_zeros((len(local), batch, horizon))
    for k, x in enumerate(local):
        full[k].index_copy_(1, positions, x.squeeze(-1))
    if per_sample:
        for b in range(batch):
            for k in range(len(local)):
                dist.all_reduce(full[k, b], group=group)  # a contiguous view: reduced in place
    else:
        dist.all_reduce(full, group=group)
    value, next_value, reward = (x.unsqueeze(-1) for x in full)
    advantage, target = masked_generalized_advantage_estimate(
        gamma, lmbda, value, next_value, reward, *replicated)
    return advantage.index_select(1, positions), target.index_select(1, positions)


def _worker(rank: int, cp: int, init_file: str, out_file: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=cp,
                            timeout=timedelta(seconds=600))
    dtype = getattr(torch, args.dtype)
    shuffler = random.Random(args.seed)  # the same order on every rank
    rows = []
    with torch.no_grad():
        for batch, horizon in args.shapes:
            work = make_workload(batch, horizon, dtype=dtype, seed=args.seed)
            full = work.inputs()
            lengths = cp_chunk_lengths(horizon, cp, args.layout)
            shard = lambda x, dim=1: cp_shard(x, rank, cp, layout=args.layout, time_dim=dim,
                                              chunk_lengths=lengths)
            local = [shard(x) for x in full[:5]] + [shard(full[5])]
            positions = shard(torch.arange(horizon), 0)
            replicated = list(full[3:])
            fns = {
                "masked_rl_cp": lambda: cp_masked_generalized_advantage_estimate(
                    args.gamma, args.lmbda, *local, layout=args.layout, chunk_lengths=lengths),
                "rebuild_per_sample": lambda: rebuild_gae(
                    args.gamma, args.lmbda, local[:3], replicated, positions, horizon),
                "rebuild_one_call": lambda: rebuild_gae(
                    args.gamma, args.lmbda, local[:3], replicated, positions, horizon,
                    per_sample=False),
            }
            traffic, outputs = {}, {}
            for key, fn in fns.items():
                with count_collectives() as calls:
                    outputs[key] = fn()
                traffic[key] = (len(calls), sum(sent for _, sent in calls))
            reference = outputs["rebuild_one_call"][0]  # a rank may hold no step (T < cp)
            scale = max(1.0, float(reference.abs().max())) if reference.numel() else 1.0
            for key in IMPLEMENTATIONS[1:]:
                for got, want in zip(outputs["masked_rl_cp"], outputs[key]):
                    error = float((got - want).abs().max()) / scale if got.numel() else 0.0
                    if not error <= args.tolerance:
                        raise AssertionError(
                            f"{batch}x{horizon}, rank {rank}: masked_rl_cp and {key} differ by "
                            f"{error:.2e} (relative), above --tolerance {args.tolerance}")
            del outputs
            samples = {key: [] for key in fns}
            for round_index in range(args.warmup + args.repeats):
                for key in shuffler.sample(list(fns), len(fns)):
                    dist.barrier()
                    start, cpu_start = time.perf_counter(), time.process_time()
                    fns[key]()
                    elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - cpu_start],
                                           dtype=torch.float64)
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's times
                    if round_index >= args.warmup:
                        samples[key].append(elapsed.tolist())
            for key in fns:
                rows.append(dict(
                    cp=cp, layout=args.layout, batch=batch, steps=horizon, implementation=key,
                    collectives=traffic[key][0], bytes_per_rank=traffic[key][1],
                    median_ms=1e3 * statistics.median(wall for wall, _ in samples[key]),
                    min_ms=1e3 * min(wall for wall, _ in samples[key]),
                    median_cpu_ms=1e3 * statistics.median(cpu for _, cpu in samples[key]),
                ))
    if rank == 0:
        Path(out_file).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _table(rows: list[dict]) -> str:
    lines = ["| cp | shape | implementation | collectives | bytes per rank | median ms | CPU ms | vs masked_rl_cp (time, bytes) |",
             "|---:|---|---|---:|---:|---:|---:|---|"]
    base = {(r["cp"], r["batch"], r["steps"]): r for r in rows if r["implementation"] == "masked_rl_cp"}
    for r in rows:
        ours = base[(r["cp"], r["batch"], r["steps"])]
        ratio = ("1" if r is ours else
                 f"{r['median_ms'] / ours['median_ms']:.1f}x, {r['bytes_per_rank'] / ours['bytes_per_rank']:,.0f}x")
        lines.append(f"| {r['cp']} | {r['batch']}x{r['steps']} | {r['implementation']} | "
                     f"{r['collectives']} | {r['bytes_per_rank']:,} | {r['median_ms']:.2f} | "
                     f"{r['median_cpu_ms']:.2f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``masked-rl bench-cp``: parse the options (:func:`~masked_rl_benchmarks.options.parse_cp_args`) and :func:`run`."""
    return run(parse_cp_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the benchmark on checked options; returns the exit code (1 if the implementations disagree)."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"masked-rl bench-cp: {os.cpu_count()} CPUs, load average {load:.1f} before the run, "
          f"{args.threads} thread(s) per rank", file=sys.stderr)
    rows = []
    for cp in args.cp:
        with tempfile.TemporaryDirectory() as tmp:
            out_file = Path(tmp) / "rows.json"
            # fork where available: the ranks start without re-importing torch each.
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            try:
                mp.start_processes(_worker, args=(cp, str(Path(tmp) / "init"), str(out_file), args),
                                   nprocs=cp, join=True, start_method=method)
            except mp.ProcessRaisedException as error:
                print(f"masked-rl bench-cp: cp={cp}: {str(error).strip().splitlines()[-1]}", file=sys.stderr)
                return 1
            rows += json.loads(out_file.read_text())
    table = _table(rows)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "cp.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (args.out / "cp.json").write_text(json.dumps(
        dict(rows=rows, load_average_before=load, cpus=os.cpu_count(), args={
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
