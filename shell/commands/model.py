"""``asyncgrpo model NAME``: make a packaged or GGUF model a checkpoint (once) and say what it
is.

    asyncgrpo model smollm2-135m
    asyncgrpo model path/to/model.gguf

Prints the checkpoint's directory, which ``train``, ``demo --model``, ``eval`` and
``AsyncGRPOTrainer(model=...)`` also accept under the name itself.
"""

from __future__ import annotations

import argparse
import sys

from asyncgrpo.adapters.models.packaged import PACKAGED, describe_model, resolve_model


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "model",
        help="make a packaged or .gguf model a checkpoint, once, and say what it is",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", help=f"{', '.join(PACKAGED)} or a .gguf file")
    parser.add_argument(
        "--cache-dir",
        help="where checkpoints are kept (default: "
        "$ASYNCGRPO_CACHE/models or ~/.cache/asyncgrpo/models)",
    )
    parser.set_defaults(func=model_command)


def model_command(args: argparse.Namespace) -> int:
    """``asyncgrpo model``'s exit status: 0, or 2 with the error on stderr (no traceback)."""
    try:
        run_model(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"asyncgrpo model: {error}", file=sys.stderr)
        return 2
    return 0


def run_model(args: argparse.Namespace) -> str:
    """Resolve ``args.name``; print and return the checkpoint's directory."""
    if args.name not in PACKAGED and not args.name.endswith(".gguf"):
        raise ValueError(
            f"{args.name!r} is neither a packaged model ({', '.join(PACKAGED)}) nor a .gguf "
            "file; a checkpoint directory or hub id needs no preparing"
        )
    path = resolve_model(args.name, args.cache_dir)
    print(describe_model(path))
    print(path)
    return path
