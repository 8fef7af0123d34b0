"""``AsyncGRPOConfig``: the trainer's configuration, a ``transformers.TrainingArguments``
subclass as in TRL, with the field names and defaults of TRL's ``AsyncGRPOConfig``.

Every ``TrainingArguments`` field is accepted with transformers' meaning; one the trainer
cannot honour fails at construction with the reason (see :mod:`asyncgrpo.shell.config.rules`).
Each field's default and help text are declared once, here or in ``TrainingArguments``;
``docs/configuration.md`` is generated from them (:mod:`asyncgrpo.shell.config.docs`).

A subclass adds its own fields (the curriculum example of TRL's AsyncGRPOTrainer
documentation)::

    @dataclass
    class CurriculumConfig(AsyncGRPOConfig):
        pass_rate_cap: float = 0.9

Values of the wrong type fail at construction naming the field, whether they come from
Python, a config file (:meth:`AsyncGRPOConfig.from_file`) or command-line flags.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import attrs
import torch
from transformers import TrainingArguments
from transformers.trainer_pt_utils import AcceleratorConfig
from transformers.trainer_utils import SchedulerType

from asyncgrpo.adapters.models.tool_parsers import TOOL_CALL_PARSER_NAMES
from asyncgrpo.adapters.vllm.auth import API_KEY_ENV
from asyncgrpo.adapters.vllm.sampling_params import SamplingParams
from asyncgrpo.core.loss.objectives import (
    OBJECTIVES,
    SETTINGS_TYPES,
    Objective,
    ObjectiveSettings,
    loss_type_from,
    objective_for,
    settings_for,
)
from asyncgrpo.core.loss.objectives import SETTINGS as OBJECTIVE_SETTINGS
from asyncgrpo.core.loss.objectives.base import SettingsT
from asyncgrpo.core.loss.objectives.weights import TRLSettings
from asyncgrpo.core.names import did_you_mean, spoken_list
from asyncgrpo.core.servers.routing import server_urls
from asyncgrpo.core.weights.parity import FOREIGN_WINDOW
from asyncgrpo.core.weights.sync import WEIGHT_TRANSFER_BACKENDS
from asyncgrpo.shell.config import rules as config_rules
from asyncgrpo.shell.config.checks import check_trackers, check_values
from asyncgrpo.shell.config.files import read_config
from asyncgrpo.shell.config.rules import field_names


def _help(text: str) -> dict[str, str]:
    return {"help": text}


_OBJECTIVE_SETTINGS_BY_NAME = {setting.name: setting for setting in OBJECTIVE_SETTINGS}


def _objective_setting(name: str) -> Any:
    """The config field of the objective setting ``name`` under TRL's flat name, with the
    default and help of the settings record that declares it
    (:data:`asyncgrpo.core.loss.objectives.SETTINGS`)."""
    setting = _OBJECTIVE_SETTINGS_BY_NAME[name]
    return field(default=setting.default, metadata=_help(setting.help))


@dataclass
class AsyncGRPOConfig(TrainingArguments):
    """Configuration of :class:`asyncgrpo.AsyncGRPOTrainer`: ``TrainingArguments`` plus the
    fields of TRL's ``AsyncGRPOConfig`` (the reference is docs/configuration.md). Each policy
    objective's settings are flat fields too, after ``loss_type``, as in TRL: ``epsilon``,
    ``epsilon_high``, ``vllm_importance_sampling_clip_min``/``_max`` (TRL's) and those the other
    objectives declare (:data:`asyncgrpo.core.loss.objectives.SETTINGS`), each with the default
    and help of its objective's settings record. :meth:`objective_settings` is the chosen
    objective's record built from them; a setting the chosen objective does not read is
    accepted (as TRL accepts ``epsilon_high`` whatever its loss) and checked all the same."""

    _VALID_DICT_FIELDS = [  # noqa: RUF012 (TrainingArguments' own class attribute)
        *TrainingArguments._VALID_DICT_FIELDS,
        "model_init_kwargs",
        "chat_template_kwargs",
    ]

    # TrainingArguments fields whose default differs (as in TRL's AsyncGRPOConfig)
    learning_rate: float = field(default=1e-6, metadata=_help("The initial learning rate."))
    lr_scheduler_type: SchedulerType | str = field(
        default="constant",
        metadata=_help(
            "The learning-rate schedule; decaying ones need max_steps > 0, since the "
            "number of optimizer steps of an epoch is not known in advance."
        ),
    )
    logging_steps: float = field(
        default=1,
        metadata=_help("Log a window every N optimizer steps (< 1: fraction of max_steps)."),
    )
    # transformers' TrainingArguments declares gradient_checkpointing and bf16 as bool; here None
    # (decide at start) is a value too, which TrainingArguments reads as False: the override
    # widens the type on purpose.
    gradient_checkpointing: bool | None = field(  # type: ignore[assignment]
        default=None,
        metadata=_help(
            "Activation checkpointing of the decoder layers. None: decided once the "
            "model is sharded on its device, on only when a row of token_budget tokens "
            "(unset: the server's max_model_len) would keep more than half the memory "
            "left free there after what training adds (gradients, AdamW's moments, the "
            "gathered layers) and the push snapshot without it, counted for the layers "
            "as built and what the attention backend keeps (logged at start); TRL's "
            "default is True."
        ),
    )
    bf16: bool | None = field(  # type: ignore[assignment]
        default=None,
        metadata=_help(
            "bf16 mixed precision (fp32 master weights); None: on with CUDA, and on "
            "a CPU for models of 50M parameters or more when it multiplies bf16 "
            "matrices at least 2x faster than fp32 (measured at start, logged)."
        ),
    )
    ignore_data_skip: bool = field(
        default=True,
        metadata=_help(
            "Must stay True: a resume restores the first untrained prompt from "
            "rollout_state.json instead of skipping batches."
        ),
    )
    remove_unused_columns: bool = field(
        default=False,
        metadata=_help("Must stay False: every dataset column is passed to the reward functions."),
    )

    # model
    model_init_kwargs: dict | str | None = field(
        default=None,
        metadata=_help(
            "Keyword arguments of from_pretrained when model is a "
            "path or id (a JSON string on the command line)."
        ),
    )
    dtype: str = field(
        default="float32",
        metadata=_help(
            "dtype the model is loaded in: auto, float32, bfloat16 or float16; "
            "serve the same dtype (vllm serve --dtype) for log-prob parity."
        ),
    )
    trust_remote_code: bool = field(
        default=False, metadata=_help("Allow models and tokenizers with custom code.")
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata=_help("MoE load-balancing loss coefficient; None: the model config's value."),
    )

    # generation
    num_generations: int = field(default=8, metadata=_help("Completions per prompt (>= 2)."))
    max_completion_length: int = field(
        default=2048, metadata=_help("Tokens generated per vLLM request (per turn).")
    )
    temperature: float = field(default=1.0, metadata=_help("Sampling temperature (> 0)."))
    top_p: float = field(
        default=1.0, metadata=_help("Nucleus sampling in (0, 1]; < 1 needs top_k > 0.")
    )
    top_k: int = field(default=0, metadata=_help("Top-k sampling; 0 turns it off."))
    min_p: float | None = field(
        default=None,
        metadata=_help(
            "Minimum token probability relative to the most likely; > 0 needs top_k > 0."
        ),
    )
    repetition_penalty: float = field(
        default=1.0, metadata=_help("vLLM's repetition penalty (1.0: none).")
    )
    chat_template_kwargs: dict | str | None = field(
        default=None, metadata=_help("Extra keyword arguments of apply_chat_template.")
    )
    max_tool_calling_iterations: int | None = field(
        default=None, metadata=_help("Tool-calling turns per rollout; None: no limit.")
    )
    tool_call_parser: str | None = field(
        default=None,
        metadata=_help(
            "Not in TRL. The format of the model's tool calls, named as vLLM's "
            "--tool-call-parser names it: " + ", ".join(TOOL_CALL_PARSER_NAMES) + "; None: "
            "chosen from the chat template (docs/rollouts.md, Tool-call formats)."
        ),
    )

    # server
    vllm_server_base_url: str | list[str] = field(
        default="http://localhost:8000",
        metadata=_help(
            "Base URL of the vLLM server. Not in TRL: several servers as a list (or "
            "one string of URLs separated by commas); each group goes to the least "
            "loaded one and every weight sync reaches all of them "
            "(docs/scaling.md)."
        ),
    )
    vllm_server_timeout: float = field(
        default=1800.0,
        metadata=_help(
            "Seconds to wait for the server to be ready, for a call to it (all "
            "its tries together) or a silent server, and for a server that went "
            "away mid-run to come back (docs/reliability.md); with several servers, "
            "for one of them to come back when none is left."
        ),
    )
    weight_sync_timeout: float = field(
        default=600.0,
        metadata=_help(
            "Not in TRL. Seconds one weight send to a vLLM server may take through a "
            "weight-transfer engine (nccl, asyncgrpo_gloo) before its transfer group is "
            "aborted and the push counts as that server's outage. Must stay at least "
            "60 s below ddp_timeout: the other trainer processes wait for the send in a "
            "collective, and rank 0's abort must end before their watchdog fires."
        ),
    )
    vllm_server_stall_timeout: float = field(
        default=10.0,
        metadata=_help(
            "Not in TRL. Seconds a call to the vLLM server may go unanswered before "
            "the server's /health is probed; while it does not answer either, a "
            "warning names the server every 10 s, and after vllm_server_timeout "
            "seconds of silence the run fails. With several servers, one that does "
            "not answer the probe goes out of routing at once."
        ),
    )
    vllm_server_api_key: str | None = field(
        default=None,
        metadata=_help(
            "Not in TRL. The vLLM server's API key, sent as 'Authorization: Bearer' "
            "with every request; None: VLLM_API_KEY from the environment, if set. "
            "Masked in logs and to_dict. See docs/security.md."
        ),
    )

    # loss
    score_centering: bool = field(
        default=True,
        metadata=_help(
            "Score centering over the sampler's top tokens instead of the clipped surrogate."
        ),
    )
    loss_type: str | None = field(
        default=None,
        metadata=_help(
            "Not in TRL's AsyncGRPOConfig. The policy objective (docs/objectives.md): "
            f"{spoken_list(OBJECTIVES)}. None: score_centering decides (True: "
            "score_centering, False: clipped_surrogate)."
        ),
    )
    # the objectives' settings: default and help from the record that declares each
    epsilon: float = _objective_setting("epsilon")
    epsilon_high: float | None = _objective_setting("epsilon_high")
    vllm_importance_sampling_clip_min: float = _objective_setting(
        "vllm_importance_sampling_clip_min"
    )
    vllm_importance_sampling_clip_max: float = _objective_setting(
        "vllm_importance_sampling_clip_max"
    )
    tis_token_cap: float = _objective_setting("tis_token_cap")
    tis_sequence_cap: float = _objective_setting("tis_sequence_cap")
    tis_geometric_cap: float = _objective_setting("tis_geometric_cap")
    mis_token_clip_min: float = _objective_setting("mis_token_clip_min")
    mis_token_clip_max: float = _objective_setting("mis_token_clip_max")
    mis_sequence_clip_min: float = _objective_setting("mis_sequence_clip_min")
    mis_sequence_clip_max: float = _objective_setting("mis_sequence_clip_max")
    mis_geometric_clip_min: float = _objective_setting("mis_geometric_clip_min")
    mis_geometric_clip_max: float = _objective_setting("mis_geometric_clip_max")
    icepop_alpha: float = _objective_setting("icepop_alpha")
    icepop_beta: float = _objective_setting("icepop_beta")
    behav_imp_weight_cap: float = _objective_setting("behav_imp_weight_cap")
    m2po_threshold: float = _objective_setting("m2po_threshold")
    cispo_clip_min: float = _objective_setting("cispo_clip_min")
    cispo_clip_max: float = _objective_setting("cispo_clip_max")
    num_sampler_logprobs: int = field(
        default=8, metadata=_help("Top log-probs requested per token for score centering.")
    )
    token_budget: int | None = field(
        default=None,
        metadata=_help("Most distinct tokens in one packed row; None: the server's max_model_len."),
    )

    # pipeline
    max_concurrent_rollouts: int = field(
        default=512, metadata=_help("Upper bound of rollouts in flight.")
    )
    max_staleness: int = field(
        default=4, metadata=_help("Samples more weight updates old than this are dropped.")
    )
    weight_sync_steps: int = field(
        default=1, metadata=_help("Optimizer steps between weight syncs to the server.")
    )
    weight_push_overlap: bool = field(
        default=True,
        metadata=_help(
            "Not in TRL. Push the weights from a snapshot while the next step trains "
            "(the version counts once the push has landed); False: each step waits "
            "for its push. A snapshot that does not fit twice into free memory waits "
            "either way (logged at start)."
        ),
    )
    weight_push_keeps_kv_cache: bool = field(
        default=False,
        metadata=_help(
            "Not in TRL. At a weight push, requests the server runs keep their KV cache and "
            "go on sampling with the new weights on it (the KV of their earlier tokens stays "
            "the old policy's; the importance ratio covers the difference); False: the push "
            "drops every cached block and running requests recompute theirs under the new "
            "weights. Either way each token's log-prob is the one the server sampled it "
            "with. With True each request's prefix cache is salted with the policy version "
            "the rollout process knew when it sent it, so a request sent after a push never "
            "reads a block another version computed (docs/weight_sync.md)."
        ),
    )
    weight_sync_delta: bool = field(
        default=False,
        metadata=_help(
            "Not in TRL. Push only what changed since the last push: per weight, the "
            "indices and values of the elements that differ in the server's dtype (or the "
            "whole weight where that is smaller); the server patches the policy it kept, "
            "checks each patched weight's checksum and reloads. A server that does not "
            "hold the last push (the first push, one restarted or a push failed on) gets "
            "every weight. Needs weight_transfer_backend='asyncgrpo_gloo' and merged "
            "weights (no peft_config); keeps one more copy of the weights on rank 0 and in "
            "the server's host memory (docs/scaling.md)."
        ),
    )
    weight_transfer_backend: str = field(
        default="auto",
        metadata=_help(
            "How weights reach the server: "
            + ", ".join(WEIGHT_TRANSFER_BACKENDS)
            + " (auto: the server's engine when the trainer can drive it, else "
            "disk)."
        ),
    )
    rollout_worker_timeout: float = field(
        default=300.0,
        metadata=_help(
            "Seconds without a heartbeat of the rollout process, or while the "
            "trainer waits for samples and the rollout process sends nothing at all "
            "(no group, kept or dropped), before the run fails."
        ),
    )
    harness_timeout_s: float = field(
        default=600.0,
        metadata=_help(
            "Not in TRL. HarnessAsyncGRPOTrainer: seconds one harness rollout (its "
            "session's creation, the harness's run and verify()) may take; past it "
            "the rollout is unscored, counted in harness/timed_out_count, and its "
            "session closed (docs/harness.md). OpenEnv's HarnessRunLimits has no "
            "time limit."
        ),
    )
    rollout_worker_restarts: int = field(
        default=3,
        metadata=_help(
            "Not in TRL. Times a rollout process that dies without a traceback (a "
            "signal, an out-of-memory kill) is started again from the trainer's "
            "prompt cursor (what was in flight is generated again); one more death "
            "fails the run. 0: the first death fails it."
        ),
    )
    stop_after_spreadless_steps: int | None = field(
        default=None,
        metadata=_help(
            "Not in TRL. End the run, with a checkpoint, after this many steps in a "
            "row where at least 9 in 10 groups had no reward spread (all rewards "
            "equal: nothing to learn; the policy collapsed or the task is solved). "
            "None: never (TRL's behaviour); a warning shows after 3 such steps "
            "either way, and again at 6, 12, 24... such steps in all (asyncgrpo "
            "demo --stop-after-spreadless-steps)."
        ),
    )
    stop_after_nonfinite_steps: int = field(
        default=3,
        metadata=_help(
            "Not in TRL. A step whose loss or gradient norm is not finite is "
            "skipped (the optimizer does not step; counted in "
            "train/nonfinite_step_count); this many such steps in a row end the run "
            "with a checkpoint of the last finite weights and an error suggesting a "
            "lower learning_rate (the weights diverged). At least 1."
        ),
    )
    foreign_weights_steps: int = field(
        default=3,
        metadata=_help(
            "Not in TRL. The run fails once this many of the last "
            "foreign_weights_window checked steps had a staleness-0 sampler/trainer "
            "log-prob gap larger than the dtypes explain (the server serves other "
            "weights: another trainer, another model); each such step warns, and a "
            "run that finishes with any such step fails once its model is saved. 0: "
            "only warn."
        ),
    )
    foreign_weights_window: int | None = field(
        default=None,
        metadata=_help(
            "Not in TRL. The checked steps (those with staleness-0 samples) "
            "foreign_weights_steps counts over; None: max(6, foreign_weights_steps). "
            "foreign_weights_window = foreign_weights_steps is the older 'in a row' "
            "rule. At least foreign_weights_steps."
        ),
    )

    # CPU sharing (not in TRL; see docs/configuration.md)
    cpu_sharing: str = field(
        default="auto",
        metadata=_help(
            "Not in TRL. auto: when training on CPU with the vLLM server on this "
            "host (vllm_server_base_url is loopback or this machine's name), the "
            "server and each local trainer rank get disjoint cores and torch runs "
            "one thread per core of the rank; off: threads and affinity are left to "
            "torch. See CPU sharing below."
        ),
    )
    server_cpus: int | None = field(
        default=None,
        metadata=_help(
            "Not in TRL. Cores for a vLLM server on this host under cpu_sharing "
            "(None: half, at least one; every trainer rank keeps a core)."
        ),
    )

    # evaluation (not in TRL; docs/evaluation.md)
    eval_num_generations: int = field(
        default=1,
        metadata=_help(
            "Not in TRL. Completions per held-out prompt in an evaluation: the k of "
            "eval/<name>/pass@k."
        ),
    )
    eval_temperature: float = field(
        default=0.0,
        metadata=_help(
            "Not in TRL. Sampling temperature of evaluations; 0: greedy (the same "
            "result every time at one weight version)."
        ),
    )
    eval_max_completion_length: int | None = field(
        default=None,
        metadata=_help(
            "Not in TRL. Tokens per request (per turn) in evaluations; None: max_completion_length."
        ),
    )

    # logging
    log_completions: bool = field(
        default=False, metadata=_help("Write each window's completions to completions.jsonl.")
    )
    num_completions_to_print: int | None = field(
        default=None, metadata=_help("Completions of a window shown in a table; None: all.")
    )

    def __post_init__(self) -> None:
        self._undo_derived_values()
        config_rules.check_types(self)
        config_rules.reject_unhonoured(self, config_rules.field_defaults(type(self)))
        super().__post_init__()
        check_trackers(self.report_to)
        config_rules.check_choices(self)
        check_values(self)

    def _undo_derived_values(self) -> None:
        """Give back the as-declared form of values ``TrainingArguments.__post_init__`` derives,
        so that ``dataclasses.replace`` of a built config passes the checks again."""
        if isinstance(self.accelerator_config, AcceleratorConfig) and (
            self.accelerator_config == AcceleratorConfig()
        ):
            self.accelerator_config = None
        if self.debug is None:  # what HfArgumentParser gives for an absent --debug
            self.debug = ""
        if self.include_num_input_tokens_seen is False:  # HfArgumentParser's form of "no"
            self.include_num_input_tokens_seen = "no"
        if self.use_cpu and self.dataloader_pin_memory is False:
            self.dataloader_pin_memory = True

    @cached_property
    def _setup_devices(self) -> torch.device:
        """The learner's device, without creating accelerate's distributed state (the learner
        creates the process group itself): the CPU under ``use_cpu``, else
        ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
        self.distributed_state = None
        if not self.use_cpu and torch.cuda.is_available():
            self._n_gpu = 1
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        self._n_gpu = 0
        return torch.device("cpu")

    def sampling_params(self) -> SamplingParams:
        """The sampling settings of every request: the generation fields, and the sampler's
        top log-probs when the objective needs them (``num_sampler_logprobs``, else 0)."""
        try:
            return SamplingParams(
                max_tokens=self.max_completion_length,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p or 0.0,
                repetition_penalty=self.repetition_penalty,
                num_sampler_logprobs=(
                    self.num_sampler_logprobs if self.objective().needs.sampler_topk else 0
                ),
            )
        except ValueError as error:
            raise ValueError(f"AsyncGRPOConfig.{error}") from None

    def eval_sampling_params(self) -> SamplingParams:
        """The sampling settings of an evaluation's requests: the generation fields with
        ``eval_temperature`` (0: greedy) and ``eval_max_completion_length``, no top log-probs."""
        max_tokens = self.eval_max_completion_length
        if max_tokens is None:
            max_tokens = self.max_completion_length
        try:
            return attrs.evolve(
                self.sampling_params(),
                max_tokens=max_tokens,
                temperature=self.eval_temperature,
                num_sampler_logprobs=0,
                greedy_allowed=True,
            )
        except ValueError as error:
            message = str(error).removeprefix("AsyncGRPOConfig.")
            raise ValueError(f"AsyncGRPOConfig.eval_{message}") from None

    def objective(self) -> Objective[Any]:
        """The policy objective ``loss_type`` (or ``score_centering``) names
        (:mod:`asyncgrpo.core.loss.objectives`)."""
        try:
            return objective_for(loss_type_from(self.loss_type, self.score_centering))
        except ValueError as error:
            raise ValueError(f"AsyncGRPOConfig.loss_type: {error}") from None

    def objective_settings(self) -> ObjectiveSettings:
        """The chosen objective's settings record (its ``settings_type``), from the fields of
        the same names; a bad value raises naming its field."""
        return self._settings_record(self.objective().settings_type)

    def trl_settings(self) -> TRLSettings:
        """The settings of TRL's two objectives (trust region, keep range), whatever
        ``loss_type`` is: TRL's loss metrics are computed with them for every objective."""
        return self._settings_record(TRLSettings)

    def check_objective_settings(self) -> None:
        """Check every objective setting, read by the chosen objective or not: each
        objective's settings record is built once from the fields."""
        for settings_type in SETTINGS_TYPES:
            self._settings_record(settings_type)

    def _settings_record(self, settings_type: type[SettingsT]) -> SettingsT:
        values = {setting.name: getattr(self, setting.name) for setting in OBJECTIVE_SETTINGS}
        try:
            return settings_for(settings_type, values)
        except ValueError as error:
            raise ValueError(f"AsyncGRPOConfig: {error}") from None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass adds fields of its own; an objective setting keeps the one default its
        record declares, so redeclaring one raises TypeError."""
        super().__init_subclass__(**kwargs)
        redeclared = sorted(set(inspect.get_annotations(cls)) & set(_OBJECTIVE_SETTINGS_BY_NAME))
        if redeclared:
            raise TypeError(
                f"{cls.__name__}: {', '.join(redeclared)} is declared by its objective's settings "
                "record (asyncgrpo.core.loss.objectives), not here; pass a value to the "
                "constructor instead of a new default"
            )

    @property
    def server_urls(self) -> tuple[str, ...]:
        """The servers ``vllm_server_base_url`` names, in order
        (:func:`~asyncgrpo.core.servers.routing.server_urls`)."""
        return server_urls(self.vllm_server_base_url)

    @property
    def foreign_weights_checked_steps(self) -> int:
        """The window of the foreign-weights rule: ``foreign_weights_window``, else
        ``max(6, foreign_weights_steps)``."""
        if self.foreign_weights_window is not None:
            return self.foreign_weights_window
        return max(FOREIGN_WINDOW, self.foreign_weights_steps)

    @property
    def server_api_key(self) -> str | None:
        """The key requests to the vLLM server carry: ``vllm_server_api_key``, else
        ``VLLM_API_KEY`` from the environment, else None."""
        return self.vllm_server_api_key or os.environ.get(API_KEY_ENV) or None

    @property
    def output_path(self) -> Path:
        """``output_dir`` as a path. ``TrainingArguments.__post_init__`` sets a None
        ``output_dir`` to ``trainer_output``, so it is None only when set so afterwards.

        Raises:
            ValueError: ``output_dir`` is None.
        """
        if self.output_dir is None:
            raise ValueError(
                "AsyncGRPOConfig.output_dir is None: set it to the folder for checkpoints, "
                "logs and the saved model"
            )
        return Path(self.output_dir)

    def keyword_arguments(self, name: str) -> dict[str, Any] | None:
        """The dict field ``name`` (one of :data:`~asyncgrpo.shell.config.checks.KEYWORD_FIELDS`,
        such as ``model_init_kwargs``): a dict or None, a JSON string having been read by
        ``TrainingArguments.__post_init__``.

        Raises:
            ValueError: the field holds a string that is not a JSON object.
        """
        value = getattr(self, name)
        if isinstance(value, str):
            raise ValueError(
                f"AsyncGRPOConfig.{name}={value!r} is not a JSON object: give a dict, or on the "
                f"command line a JSON string such as '{{\"key\": 1}}'"
            )
        return value

    def to_dict(self) -> dict[str, Any]:
        """``TrainingArguments.to_dict`` (what trackers log) with the API key masked."""
        values = super().to_dict()
        if values.get("vllm_server_api_key"):
            values["vllm_server_api_key"] = "<VLLM_SERVER_API_KEY>"
        return values

    def __str__(self) -> str:
        text = super().__str__()
        if self.vllm_server_api_key:
            text = text.replace(self.vllm_server_api_key, "<VLLM_SERVER_API_KEY>")
        return text

    __repr__ = __str__

    @property
    def prompt_order_seed(self) -> int:
        """The seed of the prompt order: ``data_seed``, else ``seed``."""
        return self.seed if self.data_seed is None else self.data_seed

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> AsyncGRPOConfig:
        """Read the fields from a TOML, YAML or JSON file (top level or an ``asyncgrpo``
        table; see :func:`asyncgrpo.shell.config.files.read_config`); ``overrides`` win."""
        values, extra = read_config(path, cls)
        if extra:
            raise ValueError(
                f"{path}: {sorted(extra)} are not AsyncGRPOConfig fields"
                + did_you_mean(sorted(extra)[0], field_names(cls))
            )
        return cls(**{**values, **overrides})

    from_toml = from_file
