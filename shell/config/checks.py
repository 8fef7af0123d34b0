"""The checks of :class:`~asyncgrpo.AsyncGRPOConfig`'s own values, each and across fields: the
run's shape (generations, staleness against weight syncs), the servers, sampling, the policy
objective and its settings, evaluation, trackers. The checks every field goes through (types,
choices, inherited fields the trainer cannot honour) are in :mod:`asyncgrpo.shell.config.rules`.
"""

from __future__ import annotations

from typing import Any

from transformers.trainer_utils import SchedulerType

from asyncgrpo.adapters.models.tool_parsers import check_tool_call_parser_name
from asyncgrpo.core.servers.cpu_plan import check_cpu_sharing
from asyncgrpo.core.servers.routing import server_urls
from asyncgrpo.core.weights.sync import check_backend

KEYWORD_FIELDS = (
    "model_init_kwargs",
    "chat_template_kwargs",
    "lr_scheduler_kwargs",
    "gradient_checkpointing_kwargs",
)
"""Fields of keyword arguments: a dict or None (a JSON object string is read as a dict)."""


WEIGHT_SYNC_MARGIN_S = 60.0
"""Seconds ``weight_sync_timeout`` must stay below ``ddp_timeout``: after a send outlives its
watchdog, rank 0 aborts the transfer group (up to 10 s for the send to give up), resumes the
server (up to 5 s) and runs the gathers the other ranks are in; all of that must end before
the other ranks' collective watchdog (``ddp_timeout``) fires."""


def check_weight_sync_timeout(weight_sync_timeout: float, ddp_timeout: float) -> None:
    """Refuse a ``weight_sync_timeout`` (seconds) that is not > 0, or that leaves less than
    :data:`WEIGHT_SYNC_MARGIN_S` before ``ddp_timeout`` (seconds).

    Example:
        >>> check_weight_sync_timeout(600.0, 1800)
    """
    if not weight_sync_timeout > 0:
        raise ValueError(
            f"AsyncGRPOConfig.weight_sync_timeout must be > 0 seconds, got {weight_sync_timeout}"
        )
    if weight_sync_timeout > ddp_timeout - WEIGHT_SYNC_MARGIN_S:
        raise ValueError(
            f"AsyncGRPOConfig.weight_sync_timeout={weight_sync_timeout:g} s leaves less than "
            f"{WEIGHT_SYNC_MARGIN_S:g} s before ddp_timeout={ddp_timeout:g} s: with several "
            "trainer processes the others wait for a weight send in a collective, and their "
            "watchdog would fire before rank 0 has aborted a hung send. Lower "
            f"weight_sync_timeout to at most {ddp_timeout - WEIGHT_SYNC_MARGIN_S:g} or raise "
            f"ddp_timeout to at least {weight_sync_timeout + WEIGHT_SYNC_MARGIN_S:g}"
        )


def check_values(config: Any) -> None:
    """The fields' values, each and across fields (``config`` an ``AsyncGRPOConfig``, whose
    ``__post_init__`` calls this); a bad value raises naming the field and the fix."""
    for name in KEYWORD_FIELDS:
        config.keyword_arguments(name)
    _check_positive(
        config,
        "num_generations",
        "gradient_accumulation_steps",
        "max_concurrent_rollouts",
        "weight_sync_steps",
    )
    if config.num_generations < 2:
        raise ValueError(
            "AsyncGRPOConfig.num_generations must be >= 2: advantages are computed within a group"
        )
    if config.max_staleness < 0:
        raise ValueError("AsyncGRPOConfig.max_staleness must be >= 0")
    if config.max_staleness < config.weight_sync_steps - 1:
        raise ValueError(
            f"AsyncGRPOConfig.max_staleness={config.max_staleness} is below "
            f"weight_sync_steps - 1 = {config.weight_sync_steps - 1}: the last steps before a "
            "weight sync would train only samples more than max_staleness behind, so no "
            "sample could be trained; raise max_staleness or lower weight_sync_steps"
        )
    check_backend(config.weight_transfer_backend)
    server_urls(config.vllm_server_base_url)
    if config.rollout_worker_restarts < 0:
        raise ValueError(
            "AsyncGRPOConfig.rollout_worker_restarts must be >= 0, got "
            f"{config.rollout_worker_restarts}"
        )
    if not (config.vllm_server_timeout > 0 and config.vllm_server_stall_timeout > 0):
        raise ValueError(
            "AsyncGRPOConfig.vllm_server_timeout and vllm_server_stall_timeout must be > 0 "
            f"seconds, got {config.vllm_server_timeout} and {config.vllm_server_stall_timeout}"
        )
    check_weight_sync_timeout(config.weight_sync_timeout, config.ddp_timeout)
    if not config.harness_timeout_s > 0:
        raise ValueError(
            f"AsyncGRPOConfig.harness_timeout_s must be > 0 seconds, got {config.harness_timeout_s}"
        )
    if config.stop_after_spreadless_steps is not None and config.stop_after_spreadless_steps < 1:
        raise ValueError(
            "AsyncGRPOConfig.stop_after_spreadless_steps must be >= 1 or None, got "
            f"{config.stop_after_spreadless_steps}"
        )
    _check_positive(config, "stop_after_nonfinite_steps")
    if config.foreign_weights_steps < 0:
        raise ValueError(
            "AsyncGRPOConfig.foreign_weights_steps must be >= 0 (0 only warns), got "
            f"{config.foreign_weights_steps}"
        )
    if config.foreign_weights_window is not None and config.foreign_weights_window < max(
        config.foreign_weights_steps, 1
    ):
        raise ValueError(
            f"AsyncGRPOConfig.foreign_weights_window={config.foreign_weights_window} must be "
            f">= foreign_weights_steps={config.foreign_weights_steps} (and >= 1): the run "
            "fails once foreign_weights_steps of the last foreign_weights_window checked "
            "steps show foreign weights"
        )
    check_cpu_sharing(config.cpu_sharing, config.server_cpus)
    config.sampling_params()  # checks the sampling fields (temperature, top_p, ...)
    if config.top_k < 0:
        raise ValueError("AsyncGRPOConfig.top_k must be >= 0 (0 disables top-k)")
    if config.top_p < 1.0 and config.top_k == 0:
        raise ValueError(
            "AsyncGRPOConfig.top_p < 1 needs top_k > 0 as well: vLLM caps the candidate "
            "set it returns at top_k (set e.g. top_k=512)"
        )
    if config.min_p is not None and config.min_p > 0 and config.top_k == 0:
        raise ValueError("AsyncGRPOConfig.min_p > 0 needs top_k > 0 as well")
    config.check_objective_settings()  # every objective setting, its objective chosen or not
    objective = config.objective()  # checks loss_type
    if objective.needs.sampler_topk and config.num_sampler_logprobs < 1:
        raise ValueError(
            f"AsyncGRPOConfig.num_sampler_logprobs must be >= 1 with loss_type="
            f"{objective.name!r}: it needs the sampler's top log-probs"
        )
    _check_positive(config, "eval_num_generations")
    config.eval_sampling_params()  # checks the evaluation's sampling fields
    if config.token_budget is not None and config.token_budget < 1:
        raise ValueError("AsyncGRPOConfig.token_budget must be >= 1 or None")
    if config.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(
            f"AsyncGRPOConfig.dtype must be auto, float32, bfloat16 or "
            f"float16, got {config.dtype!r}"
        )
    if config.max_tool_calling_iterations is not None and config.max_tool_calling_iterations < 0:
        raise ValueError("AsyncGRPOConfig.max_tool_calling_iterations must be >= 0 or None")
    check_tool_call_parser_name(config.tool_call_parser)
    schedule = SchedulerType(config.lr_scheduler_type).value
    if schedule not in ("constant", "constant_with_warmup") and config.max_steps <= 0:
        raise ValueError(
            "AsyncGRPOConfig.lr_scheduler_type decays over optimizer steps, whose number "
            "is unknown in advance; set max_steps explicitly with a decaying schedule"
        )


def _check_positive(config: Any, *names: str) -> None:
    for name in names:
        if getattr(config, name) < 1:
            raise ValueError(f"AsyncGRPOConfig.{name} must be >= 1, got {getattr(config, name)}")


def check_trackers(report_to: str | list[str] | None) -> None:
    """``report_to`` names integrations transformers reports to. Typed as ``TrainingArguments``
    declares it; its ``__post_init__`` makes it a list (``"all"``/``"none"`` read, one name or
    None wrapped), which this checks."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    names = report_to if isinstance(report_to, list) else [report_to]
    unknown = sorted(set(names) - set(INTEGRATION_TO_CALLBACK), key=str)
    if unknown:
        raise ValueError(
            f"AsyncGRPOConfig.report_to names unknown trackers {unknown}; use transformers' "
            f"integrations ({', '.join(sorted(INTEGRATION_TO_CALLBACK))}), all or none"
        )
