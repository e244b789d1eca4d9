"""The options of ``masked-rl bench`` and ``masked-rl bench-cp``, parsed and checked without torch.

``--help`` and every option error come back before torch is imported (about 4 s on a small
machine); :func:`parse_bench_args` and :func:`parse_cp_args` return a checked
``argparse.Namespace`` that :func:`masked_rl_benchmarks.bench.run` and
:func:`masked_rl_benchmarks.cp.run` take.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from masked_rl_examples.ppo_tool_use.config import OneLineErrorParser, check_writable_folder

__all__ = [
    "BENCH_SHAPES",
    "CUDA_EXTRA_SHAPES",
    "CP_SHAPES",
    "IMPLEMENTATIONS",
    "parse_shape",
    "bench_parser",
    "parse_bench_args",
    "cp_parser",
    "parse_cp_args",
]

BENCH_SHAPES = ((8, 32768), (32, 16384), (64, 4096), (256, 4096), (512, 1024), (1024, 1024))
"""``masked-rl bench``'s default grid (batch, steps)."""
CUDA_EXTRA_SHAPES = ((256, 32768),)
"""Added to the default grid with ``--device cuda``."""
CP_SHAPES = ((16, 32768), (4, 131072))
"""``masked-rl bench-cp``'s default shapes."""

# key: (label in the table, the key whose time the ratio divides by)
IMPLEMENTATIONS = {
    "ours": ("masked_gae function (ours)", "ours"),
    "ours_module": ("MaskedGAE on a TensorDict (ours)", "ours"),
    "per_sample": ("per-sample packed chunk scan", "ours"),
    "per_step": ("per-step loop over t", "ours"),
    "reference": ("reference algorithm (per-row chunk-128 scan)", "ours"),
    "floor": ("memory floor (one pass, 2 where)", "ours"),
    "ours_all_ones": ("masked_gae, all-ones mask (ours)", "ours_all_ones"),
    "torchrl_all_ones": ("TorchRL vec GAE, no mask", "ours_all_ones"),
}


def parse_shape(text: str) -> tuple[int, int]:
    """``"64x4096"`` -> ``(64, 4096)``; an ``argparse`` type."""
    try:
        batch, steps = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is BATCHxSTEPS, e.g. 64x4096, got {text!r}")
    if batch < 1 or steps < 1:
        raise argparse.ArgumentTypeError(f"a shape needs positive sizes, got {text!r}")
    return batch, steps


def _shapes(shapes) -> str:
    return " ".join(f"{n}x{t}" for n, t in shapes)


def bench_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(
        prog="masked-rl bench",
        description="Time masked GAE against the reference system's algorithm, a per-sample "
        "packed scan, a per-step loop, TorchRL's vectorized GAE and a one-pass memory floor; "
        "print a table and write CSV and JSON.",
    )
    parser.add_argument("--shapes", type=parse_shape, nargs="+", metavar="NxT",
                        help=f"batch x steps (default: {_shapes(BENCH_SHAPES)}, plus "
                        f"{_shapes(CUDA_EXTRA_SHAPES)} on CUDA)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--repeats", type=int, default=11, help="timed rounds per shape (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds before them")
    parser.add_argument("--min-time-ms", type=float, default=50.0,
                        help="a timed sample repeats a fast call back to back until it spans "
                        "about this long (calibrated in the last warmup round; default 50)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time per call by the wall clock (default) or by this process's CPU "
                        "time, which other processes on a busy machine skew far less (use it "
                        "with --threads 1; CPU only); the other clock goes to the CSV and JSON")
    parser.add_argument("--gamma", type=float, default=1.0)
    parser.add_argument("--lmbda", type=float, default=0.95)
    parser.add_argument("--chunk", type=int, default=64, help="chunk of the per-sample scan")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--implementations", nargs="+", choices=tuple(IMPLEMENTATIONS),
                        default=list(IMPLEMENTATIONS), metavar="NAME",
                        help="subset of: " + ", ".join(IMPLEMENTATIONS)
                        + " (a ratio needs its reference: ours / ours_all_ones)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads for the run (default: torch's choice)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    parser.add_argument("--out", type=Path, default=Path("bench_results"),
                        help="folder for bench.csv and bench.json (default bench_results/)")
    return parser


def _check_device(parser: argparse.ArgumentParser, device: str) -> None:
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
        parser.error(f"--device must be cpu, cuda or cuda:N, got {device!r}")


def _check_discounts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("gamma", "lmbda"):
        value = getattr(args, name)
        if not 0.0 <= value <= 1.0:  # nan too
            parser.error(f"--{name} must be in [0, 1], got {value}")


def _check_writable(parser: argparse.ArgumentParser, folder: Path) -> None:
    try:  # before the benchmark runs, not after
        check_writable_folder("--out", folder)
    except ValueError as err:
        parser.error(str(err))


def parse_bench_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``masked-rl bench``'s options, checked; a mistake exits with a one-line error (status 2)."""
    parser = bench_parser()
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.chunk < 1:
        parser.error("--repeats and --chunk must be >= 1 and --warmup >= 0, got "
                     f"{args.repeats}, {args.chunk} and {args.warmup}")
    if not args.min_time_ms >= 0:  # nan too
        parser.error(f"--min-time-ms must be >= 0, got {args.min_time_ms}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    _check_discounts(parser, args)
    _check_device(parser, args.device)
    if args.device.startswith("cuda") and args.clock == "cpu":
        parser.error("--clock cpu times the CPU only; use the wall clock with --device cuda")
    _check_writable(parser, args.out)
    return args


def cp_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(
        prog="masked-rl bench-cp",
        description="Context-parallel masked GAE vs rebuilding full rows, on N gloo ranks.",
    )
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4], help="CP sizes (ranks); default 2 4")
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=list(CP_SHAPES),
                        metavar="NxT", help=f"batch x steps; default {_shapes(CP_SHAPES)}")
    parser.add_argument("--layout", choices=("contiguous", "zigzag"), default="zigzag")
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds (median); default 15")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first; default 2")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank; default 1")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--lmbda", type=float, default=0.95)
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="largest relative disagreement accepted; default 1e-4 (float32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench_results"),
                        help="folder for cp.csv and cp.json; default bench_results/")
    return parser


def parse_cp_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``masked-rl bench-cp``'s options, checked; a mistake exits with a one-line error."""
    parser = cp_parser()
    args = parser.parse_args(argv)
    if min(args.cp) < 1 or args.repeats < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--cp, --repeats and --threads must be >= 1 and --warmup >= 0, got "
                     f"{args.cp}, {args.repeats}, {args.threads} and {args.warmup}")
    if not args.tolerance >= 0:
        parser.error(f"--tolerance must be >= 0, got {args.tolerance}")
    _check_discounts(parser, args)
    _check_writable(parser, args.out)
    return args
