"""The ``asyncgrpo`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import attrs

from asyncgrpo.shell.metrics_log import configure_logging
from asyncgrpo.shell.plots import plot_run
from asyncgrpo.shell.simulate import SimulationConfig, simulate


def _add_simulation_flags(parser: argparse.ArgumentParser) -> None:
    for field in attrs.fields(SimulationConfig):
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(
            flag,
            type=type(field.default),
            default=field.default,
            help=f"(default: {field.default})",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncgrpo", description=__doc__)
    parser.add_argument("--json-logs", action="store_true", help="log JSON lines to stderr")
    commands = parser.add_subparsers(dest="command", required=True)
    sim = commands.add_parser(
        "simulate",
        help="simulate the asynchronous pipeline (pacing, staleness, scoring) in seconds",
        description="Simulated generation and training, real core decisions; writes "
        "metrics.jsonl to --output-dir.",
    )
    sim.add_argument("--output-dir", required=True, help="where metrics.jsonl is written")
    sim.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    _add_simulation_flags(sim)
    plot = commands.add_parser("plot", help="plot a run's metrics.jsonl to RUN_DIR/metrics.png")
    plot.add_argument("run_dir", help="a run's output directory (holds metrics.jsonl)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(json_logs=args.json_logs)
    if args.command == "simulate":
        values = {f.name: getattr(args, f.name) for f in attrs.fields(SimulationConfig)}
        try:
            config = SimulationConfig(**values)
        except ValueError as error:
            print(f"asyncgrpo simulate: {error}", file=sys.stderr)
            return 2
        windows = simulate(config, args.output_dir, progress=not args.no_progress)
        first, last = windows[0], windows[-1]
        print(
            f"simulated {last['step']} steps: reward {first.get('reward', float('nan')):.3f} -> "
            f"{last.get('reward', float('nan')):.3f}; metrics in {args.output_dir}/metrics.jsonl"
        )
    elif args.command == "plot":
        try:
            path = plot_run(args.run_dir)
        except (FileNotFoundError, ValueError) as error:
            print(f"asyncgrpo plot: {error}", file=sys.stderr)
            return 2
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
