"""``asyncgrpo eval``: score held-out prompts for a model, a saved run or a checkpoint.

    asyncgrpo eval --model runs/x/checkpoint-20 --dataset held_out.jsonl \\
        --reward asyncgrpo.rewards:accuracy_reward --num-generations 4

Prints each metric with its 90% bootstrap interval over the prompts and writes them as JSON
(``--json``, default ``<output-dir>/evaluation.json``). Datasets are ``path`` (named
``eval``) or ``name=path``, repeated; a path is a ``.json``/``.jsonl`` file, a
``save_to_disk`` folder or ``module:function``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from asyncgrpo.shell.config import (
    AsyncGRPOConfig,
    eval_dataset_specs,
    import_named,
    load_eval_datasets,
)
from asyncgrpo.shell.experiments import evaluate_model, evaluation_table
from asyncgrpo.shell.run import eval_datasets_of


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "eval",
        help="score held-out prompts for a model, a saved run or a checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        required=True,
        help="a model directory or id, smollm2-135m, a .gguf file, a LoRA "
        "adapter directory, or a run's checkpoint-<step> directory",
    )
    parser.add_argument(
        "--dataset",
        action="append",
        required=True,
        metavar="[NAME=]PATH",
        help="held-out prompts (repeat for several)",
    )
    parser.add_argument(
        "--reward",
        action="append",
        required=True,
        metavar="MODULE:FUNCTION",
        help="reward function (repeat)",
    )
    parser.add_argument(
        "--num-generations",
        type=int,
        default=1,
        help="completions per prompt, the k of pass@k (default: 1)",
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)"
    )
    parser.add_argument(
        "--max-completion-length",
        type=int,
        default=256,
        help="tokens per completion (default: 256)",
    )
    parser.add_argument("--vllm-url", help="use this server instead of starting one")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=4096,
        help="--max-model-len of the server it starts (at most the model's)",
    )
    parser.add_argument(
        "--vllm-enforce-eager",
        action="store_true",
        help="start the server without torch.compile (sooner, slower)",
    )
    parser.add_argument(
        "--output-dir", default="runs/eval", help="where the server logs go (default: runs/eval)"
    )
    parser.add_argument("--json", help="where the metrics go (default: OUTPUT_DIR/evaluation.json)")
    parser.set_defaults(func=eval_command)


def eval_command(args: argparse.Namespace) -> int:
    """``asyncgrpo eval``'s exit status: 0, or 2 with the error on stderr (no traceback)."""
    try:
        run_eval(args)
    except (ValueError, RuntimeError, FileNotFoundError) as error:
        print(f"asyncgrpo eval: {error}", file=sys.stderr)
        return 2
    return 0


def named_datasets(specs: list[str]) -> dict[str, object]:
    """``[NAME=]PATH`` specs -> datasets by name (a lone unnamed one is ``eval``;
    :func:`~asyncgrpo.shell.config.eval_dataset_specs`)."""
    return load_eval_datasets(eval_dataset_specs(specs, "--dataset"))


def run_eval(args: argparse.Namespace) -> dict[str, float]:
    """Evaluate as the flags say; print the table and write the JSON; the metrics."""
    config = AsyncGRPOConfig(
        output_dir=args.output_dir,
        eval_num_generations=args.num_generations,
        eval_temperature=args.temperature,
        max_completion_length=args.max_completion_length,
        max_concurrent_rollouts=64,
    )
    datasets = eval_datasets_of(named_datasets(args.dataset), None, config)
    rewards = [import_named(spec, "reward function") for spec in args.reward]
    figures = evaluate_model(
        args.model,
        datasets,
        rewards,
        config,
        vllm_url=args.vllm_url,
        max_model_len=args.max_model_len,
        enforce_eager=args.vllm_enforce_eager,
    )
    print(evaluation_table(figures))
    out = Path(args.json or Path(args.output_dir) / "evaluation.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "metrics": figures}, indent=1) + "\n")
    print(f"metrics in {out}")
    return figures
