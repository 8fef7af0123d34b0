"""Uploads to the Hugging Face Hub through ``huggingface_hub``, as transformers' Trainer does:
the repository is ``hub_model_id`` (default: the name of ``output_dir``), the token is the
call's, else ``hub_token``, else the ``huggingface_hub`` login.

A missing token fails before any network call; a hub that cannot be reached fails with an
error that says so and carries the cause.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import HTTPError  # the HTTP client huggingface_hub uses

IGNORED = ["checkpoint-*/**", ".vllm_weights/**", ".vllm_lora/**", "*.log"]
"""Run-directory files that are not the model (checkpoints are pushed by hub_strategy)."""


class HubError(RuntimeError):
    """push_to_hub could not upload: no token, or the hub cannot be reached."""


def repo_id(args: Any) -> str:
    """``hub_model_id``, else the name of ``output_dir``."""
    return args.hub_model_id or Path(args.output_dir).absolute().name


def resolve_token(args: Any, token: str | None = None) -> str:
    """The token to push with; a ``HubError`` saying how to give one when there is none."""
    found = token or args.hub_token or get_token()
    if not found:
        raise HubError(
            "push_to_hub needs a Hugging Face token with write access: pass token=..., set "
            "hub_token in AsyncGRPOConfig, set HF_TOKEN, or run `hf auth login`"
        )
    return found


def upload(
    args: Any,
    folder: str | Path,
    *,
    commit_message: str,
    token: str | None = None,
    revision: str | None = None,
    path_in_repo: str | None = None,
    blocking: bool = True,
) -> Any:
    """Create the repository if needed and upload ``folder`` (``huggingface_hub`` calls).

    Returns:
        huggingface_hub's ``CommitInfo``, or a ``Future`` of it when not ``blocking``.
    """
    api = HfApi(token=resolve_token(args, token))
    repo = repo_id(args)
    try:
        api.create_repo(repo, private=args.hub_private_repo, exist_ok=True)
        upload_arguments: dict[str, Any] = {
            "repo_id": repo,
            "folder_path": str(folder),
            "path_in_repo": path_in_repo,
            "commit_message": commit_message,
            "revision": revision or args.hub_revision,
            "ignore_patterns": None if path_in_repo else IGNORED,
        }
        # huggingface_hub overloads run_as_future on its literal values, True or False
        if blocking:
            return api.upload_folder(**upload_arguments, run_as_future=False)
        return api.upload_folder(**upload_arguments, run_as_future=True)
    except (OSError, HTTPError) as error:  # no connection, or the hub refused
        raise HubError(
            f"push_to_hub could not upload {folder} to {repo!r} on {api.endpoint}: {error} "
            "(no network, or a token without write access?)"
        ) from error


def write_model_card(folder: Path, base_model: str, **fields: Any) -> None:
    """A README.md whose YAML header holds the documented model-card fields given
    (``license``, ``tags``, ``dataset_name``, ``language``, ...) and the base model."""
    import yaml

    header = {
        "base_model": base_model,
        "library_name": "transformers",
        "tags": ["asyncgrpo", "grpo", *list(fields.pop("tags", None) or [])],
    }
    if "dataset_name" in fields:
        fields["datasets"] = [fields.pop("dataset_name")]
    header.update({k: v for k, v in fields.items() if v is not None})
    name = header.pop("model_name", None) or folder.absolute().name
    text = f"---\n{yaml.safe_dump(header, sort_keys=False)}---\n\n# {name}\n\n"
    text += f"Trained from {base_model} with asynchronous GRPO (asyncgrpo).\n"
    (folder / "README.md").write_text(text)
