"""``AsyncGRPOConfig``: the trainer's configuration, with TRL's field names and defaults.

A plain dataclass, so a subclass can add its own fields (the curriculum example of TRL's
AsyncGRPOTrainer documentation)::

    @dataclass
    class CurriculumConfig(AsyncGRPOConfig):
        pass_rate_cap: float = 0.9

Combinations TRL's AsyncGRPOTrainer rules out fail at construction with an error that names the
field and says why. :meth:`AsyncGRPOConfig.from_toml` reads a TOML file of the same fields.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncgrpo.core.cpu_plan import check_cpu_sharing
from asyncgrpo.core.weight_sync import check_backend

_UNSUPPORTED = {
    "use_liger_kernel": "use_liger_kernel=True is not supported by AsyncGRPOTrainer",
    "deepspeed": "DeepSpeed is not supported; sharded training uses FSDP2",
    "fp16": "fp16 is not supported; use bf16 (GPU) or fp32",
}


@dataclass
class AsyncGRPOConfig:
    """Configuration of :class:`asyncgrpo.AsyncGRPOTrainer` (defaults as in TRL's AsyncGRPOTrainer).

    Training arguments used by the loop: ``output_dir``, ``learning_rate`` (1e-6),
    ``lr_scheduler_type`` ("constant"), ``warmup_steps``, ``weight_decay``, ``adam_beta1``,
    ``adam_beta2``, ``adam_epsilon``, ``max_steps`` (-1: stop on ``num_train_epochs``),
    ``num_train_epochs`` (passes over the prompts, counted in distinct prompts),
    ``gradient_accumulation_steps``, ``max_grad_norm``, ``logging_steps`` (1), ``save_steps``,
    ``save_total_limit``, ``seed``, ``bf16`` (None: on for CUDA, off on CPU),
    ``gradient_checkpointing`` (True), ``report_to``, ``resume_from_checkpoint``.

    Model: ``model_init_kwargs``, ``dtype`` ("float32"), ``trust_remote_code``,
    ``router_aux_loss_coef``. Generation: ``num_generations`` (8), ``max_completion_length``
    (2048, tokens per turn), ``temperature``, ``top_p``, ``top_k``, ``min_p``,
    ``repetition_penalty``, ``chat_template_kwargs``, ``max_tool_calling_iterations``.
    Server: ``vllm_server_base_url``, ``vllm_server_timeout`` (seconds). Loss: ``epsilon``,
    ``epsilon_high``, ``score_centering``, ``vllm_importance_sampling_clip_min``/``_max``,
    ``num_sampler_logprobs``, ``token_budget``. Pipeline: ``max_concurrent_rollouts``,
    ``max_staleness``, ``weight_sync_steps``, ``weight_transfer_backend`` (``"auto"``: the
    server's engine when the trainer can drive it, else the disk; or ``"disk"``, ``"nccl"``,
    ``"asyncgrpo_gloo"``), ``rollout_worker_timeout`` (seconds).
    CPU sharing (not in TRL; see docs/configuration.md): ``cpu_sharing`` (``"auto"``: when
    training on CPU beside a vLLM server on this host, server and trainer ranks get disjoint
    cores and torch one thread per core of its rank; ``"off"``: torch's defaults),
    ``server_cpus`` (cores for that server; None: half, at least one).
    Logging: ``log_completions``, ``num_completions_to_print``.
    """

    output_dir: str | None = None
    learning_rate: float = 1e-6
    lr_scheduler_type: str = "constant"
    warmup_steps: float = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_steps: int = -1
    num_train_epochs: float = 3.0
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    logging_steps: float = 1
    save_steps: float = 500
    save_strategy: str = "steps"
    save_total_limit: int | None = None
    seed: int = 42
    bf16: bool | None = None
    fp16: bool = False
    gradient_checkpointing: bool = True
    report_to: str | list[str] | None = "none"
    run_name: str | None = None
    disable_tqdm: bool | None = None
    resume_from_checkpoint: str | None = None
    ignore_data_skip: bool = True
    remove_unused_columns: bool = False
    use_liger_kernel: bool = False
    deepspeed: dict[str, Any] | str | None = None

    model_init_kwargs: dict[str, Any] | None = None
    dtype: str = "float32"
    trust_remote_code: bool = False
    router_aux_loss_coef: float | None = None

    num_generations: int = 8
    max_completion_length: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    chat_template_kwargs: dict[str, Any] | None = None
    max_tool_calling_iterations: int | None = None

    vllm_server_base_url: str = "http://localhost:8000"
    vllm_server_timeout: float = 1800.0

    epsilon: float = 0.2
    epsilon_high: float | None = None
    score_centering: bool = True
    vllm_importance_sampling_clip_min: float = 0.5
    vllm_importance_sampling_clip_max: float = 5.0
    num_sampler_logprobs: int = 8
    token_budget: int | None = None

    max_concurrent_rollouts: int = 512
    max_staleness: int = 4
    weight_sync_steps: int = 1
    weight_transfer_backend: str = "auto"
    rollout_worker_timeout: float = 300.0
    cpu_sharing: str = "auto"
    server_cpus: int | None = None

    log_completions: bool = False
    num_completions_to_print: int | None = None

    def __post_init__(self) -> None:
        for name, why in _UNSUPPORTED.items():
            if getattr(self, name):
                raise ValueError(f"AsyncGRPOConfig.{name}: {why}")
        if self.remove_unused_columns:
            raise ValueError(
                "AsyncGRPOConfig.remove_unused_columns must stay False: every dataset column "
                "is passed to the reward functions"
            )
        if not self.ignore_data_skip:
            raise ValueError(
                "AsyncGRPOConfig.ignore_data_skip must stay True: resuming restores the first "
                "untrained prompt from rollout_state.json instead of skipping batches"
            )
        self._check_positive("num_generations", "max_completion_length",
                             "gradient_accumulation_steps", "max_concurrent_rollouts",
                             "weight_sync_steps")  # fmt: skip
        if self.num_generations < 2:
            raise ValueError(
                "AsyncGRPOConfig.num_generations must be >= 2: advantages are "
                "computed within a group"
            )
        if self.max_staleness < 0:
            raise ValueError("AsyncGRPOConfig.max_staleness must be >= 0")
        check_backend(self.weight_transfer_backend)
        check_cpu_sharing(self.cpu_sharing, self.server_cpus)
        if self.temperature <= 0:
            raise ValueError("AsyncGRPOConfig.temperature must be > 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"AsyncGRPOConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError("AsyncGRPOConfig.top_k must be >= 0 (0 disables top-k)")
        if self.top_p < 1.0 and self.top_k == 0:
            raise ValueError(
                "AsyncGRPOConfig.top_p < 1 needs top_k > 0 as well: vLLM caps the candidate "
                "set it returns at top_k (set e.g. top_k=512)"
            )
        if self.min_p is not None and self.min_p > 0 and self.top_k == 0:
            raise ValueError("AsyncGRPOConfig.min_p > 0 needs top_k > 0 as well")
        if not (0 <= self.vllm_importance_sampling_clip_min <= 1
                <= self.vllm_importance_sampling_clip_max):  # fmt: skip
            raise ValueError(
                "AsyncGRPOConfig.vllm_importance_sampling_clip_min must be <= 1 <= "
                "vllm_importance_sampling_clip_max"
            )
        if self.score_centering and self.num_sampler_logprobs < 1:
            raise ValueError(
                "AsyncGRPOConfig.num_sampler_logprobs must be >= 1 with score_centering=True"
            )
        if self.token_budget is not None and self.token_budget < 1:
            raise ValueError("AsyncGRPOConfig.token_budget must be >= 1 or None")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"AsyncGRPOConfig.dtype must be auto, float32, bfloat16 or "
                f"float16, got {self.dtype!r}"
            )
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            raise ValueError("AsyncGRPOConfig.max_tool_calling_iterations must be >= 0 or None")
        if self.lr_scheduler_type not in ("constant", "constant_with_warmup", "linear",
                                          "cosine"):  # fmt: skip
            raise ValueError(
                f"AsyncGRPOConfig.lr_scheduler_type {self.lr_scheduler_type!r} is not "
                "supported; use constant, constant_with_warmup, linear or cosine"
            )
        if self.lr_scheduler_type in ("linear", "cosine") and self.max_steps <= 0:
            raise ValueError(
                "AsyncGRPOConfig.lr_scheduler_type decays over optimizer steps, whose number "
                "is unknown in advance; set max_steps explicitly with a decaying schedule"
            )

    def _check_positive(self, *names: str) -> None:
        for name in names:
            if getattr(self, name) < 1:
                raise ValueError(f"AsyncGRPOConfig.{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> AsyncGRPOConfig:
        """Read the fields from a TOML file (top level or an ``[asyncgrpo]`` table);
        ``overrides`` win. An unknown key is an error naming it."""
        data = tomllib.loads(Path(path).read_text())
        data = dict(data.get("asyncgrpo", data))
        data.update(overrides)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown AsyncGRPOConfig fields {unknown}")
        return cls(**data)
