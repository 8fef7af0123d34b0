"""``AsyncGRPOTrainer``: the rollout process streams scored samples, the learner trains on them.

The constructor follows TRL's AsyncGRPOTrainer: it checks its arguments
(:mod:`asyncgrpo.shell.run.inputs`), loads the model and tokenizer, and
:meth:`AsyncGRPOTrainer.train` opens the learner and runs the step loop
(:class:`~asyncgrpo.shell.run.training_run.TrainingRun`). The trainer holds its callbacks
(:class:`~asyncgrpo.shell.run.callbacks.Callbacks`) and a
:class:`~asyncgrpo.shell.run.publishing.Publisher` for ``save_model`` and ``push_to_hub``, as
transformers' ``Trainer`` offers them.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from transformers import (
    AutoTokenizer,
    PreTrainedModel,
    TrainerCallback,
    TrainerState,
    enable_full_determinism,
    set_seed,
)
from transformers.integrations import get_reporting_integration_callbacks
from transformers.trainer_callback import CallbackHandler
from transformers.utils import logging as transformers_logging

from asyncgrpo.adapters.kernels.architecture_support import training_path
from asyncgrpo.adapters.models.causal_lm import load_causal_lm
from asyncgrpo.adapters.models.packaged import resolve_model
from asyncgrpo.adapters.models.tool_parsers import check_tool_template
from asyncgrpo.adapters.process_group import default_device, launch_rank
from asyncgrpo.core.experiments.evaluation import evaluation_metrics
from asyncgrpo.core.names import did_you_mean
from asyncgrpo.shell.config import AsyncGRPOConfig, field_names, use_log_levels
from asyncgrpo.shell.learner import Learner
from asyncgrpo.shell.rollout import AsyncRolloutLoop, evaluate_now
from asyncgrpo.shell.run import checkpoints, hub
from asyncgrpo.shell.run.callbacks import Callbacks
from asyncgrpo.shell.run.evaluations import evaluation_spec, push_to_servers
from asyncgrpo.shell.run.inputs import (
    RunInputs,
    check_dataset,
    eval_datasets_of,
    reward_function_list,
)
from asyncgrpo.shell.run.interrupts import (
    TrainingInterrupted,
    failures_outrank_signals,
    signal_name,
    signals_interrupt,
    signum_of,
)
from asyncgrpo.shell.run.publishing import FinalModel, Publisher
from asyncgrpo.shell.run.training_run import RunBooks, TrainingRun, TrainOutput
from asyncgrpo.shell.servers import ServerSettings, cpus_shared_with_server

if TYPE_CHECKING:
    from asyncgrpo.core.servers.cpu_plan import CpuPlan


_FIXED_AT_CONSTRUCTION = ("model_init_kwargs", "dtype", "trust_remote_code")
"""Config fields used when the trainer is built (loading the model), not by train()."""


def seed_everything(config: AsyncGRPOConfig) -> None:
    """Seed python, numpy and torch as transformers' Trainer does: fully deterministic
    algorithms under ``full_determinism``."""
    if config.full_determinism:
        enable_full_determinism(config.seed)
    else:
        set_seed(config.seed)


REIMPORTED_MAIN = "__mp_main__"
"""The name ``multiprocessing`` runs the main script under when a child process imports it
(spawn, and the fork server's children: the rollout process)."""


def refuse_top_level_run(action: str) -> None:
    """Raise when called, however deep, from the top level of the main script while a child
    process of ``multiprocessing`` imports it (as ``__mp_main__``): the rollout process does,
    and a script without its ``if __name__ == "__main__":`` guard would ``action`` there again,
    loading the model a second time and, under torchrun, waiting on a rendezvous that no other
    rank joins. A trainer built inside a function the child calls after that import (a
    guarded script's worker) is not refused.

    Raises:
        RuntimeError: naming the script and the guard to put around ``action``.
    """
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == (
            REIMPORTED_MAIN
        ):
            script = frame.f_code.co_filename
            raise RuntimeError(
                f"{script} {action} at its top level, and a child process (the rollout "
                "process) imports that script, running its top level again. Put the "
                f'trainer\'s construction and train() under `if __name__ == "__main__":` in '
                f"{script}; keep reward functions, tools and environment factories at module "
                "level, above it"
            )
        frame = frame.f_back


class AsyncGRPOTrainer:
    """Asynchronous GRPO: rollouts stream from a vLLM server while the learner trains.

    The constructor follows TRL's ``AsyncGRPOTrainer``. Set ``loop_cls`` on a
    subclass to customise the rollout loop. Not in TRL: ``eval_reward_funcs`` score the
    evaluations of ``eval_dataset`` where they should differ from ``reward_funcs`` (by
    default the training rewards score them too; docs/evaluation.md).

    Example::

        trainer = AsyncGRPOTrainer(model="path/to/model", reward_funcs=my_reward,
                                   train_dataset=dataset,
                                   args=AsyncGRPOConfig(output_dir="runs/x", max_steps=50))
        trainer.train()
    """

    loop_cls: type[AsyncRolloutLoop] = AsyncRolloutLoop

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: Callable[..., Any] | Sequence[Callable[..., Any]] | None = None,
        args: AsyncGRPOConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        callbacks: Sequence[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        peft_config: Any = None,
        tools: Sequence[Callable[..., Any]] | None = None,
        environment_factory: Any = None,
        eval_dataset: Any = None,
        eval_reward_funcs: Callable[..., Any] | Sequence[Callable[..., Any]] | None = None,
    ) -> None:
        refuse_top_level_run(f"builds {type(self).__name__}(...)")
        self.args = args or AsyncGRPOConfig()
        seed_everything(self.args)
        transformers_logging.set_verbosity(self.args.get_process_log_level())
        use_log_levels(self.args)  # the "asyncgrpo" logger: log_level / log_level_replica
        funcs = reward_function_list(reward_funcs, "reward_funcs")
        tasks = self._task_maker(environment_factory)
        if not funcs and tasks is None:
            raise ValueError(
                "give reward_funcs, or an environment_factory whose environments define get_reward"
            )
        check_dataset(train_dataset, tasks, self.args)
        self.eval_datasets = eval_datasets_of(eval_dataset, tasks, self.args)
        self.eval_reward_funcs = reward_function_list(eval_reward_funcs, "eval_reward_funcs")
        if self.eval_reward_funcs and not self.eval_datasets:
            raise ValueError("eval_reward_funcs score evaluations: give the eval_dataset too")
        self.reward_funcs = funcs
        self.train_dataset = train_dataset
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        self.peft_config = peft_config
        self.optimizers = optimizers
        if isinstance(model, str):
            self.model_name = resolve_model(model)  # a packaged model's name, a .gguf file
            # rank 0 reads the weights and the learner sends each rank its shards of them
            self.model = load_causal_lm(
                self.model_name,
                self.args.dtype,
                self.args.keyword_arguments("model_init_kwargs"),
                on_meta=launch_rank() > 0,
            )
        else:
            self.model_name = str(model.config._name_or_path)
            self.model = model
        training_path(self.model)  # a model no path computes exactly is refused here
        self.processing_class = processing_class or AutoTokenizer.from_pretrained(
            self.model_name, trust_remote_code=self.args.trust_remote_code
        )
        if self.processing_class.pad_token is None:
            self.processing_class.pad_token = self.processing_class.eos_token
        if self.tools or environment_factory is not None:  # the tool loop reads its replies
            check_tool_template(
                self.processing_class,
                self.args.tool_call_parser,
                self.args.keyword_arguments("chat_template_kwargs"),
            )
        self.output_dir = self.args.output_path
        trackers = get_reporting_integration_callbacks(self.args.report_to)  # report_to
        self._callbacks = Callbacks(
            [*trackers, *(callbacks or [])], self.args, self.model, self.processing_class
        )
        self._publisher = Publisher(self.args, self.model, self.processing_class, self.model_name)
        if self.args.push_to_hub:
            hub.resolve_token(self.args)  # fail at the door, not at the first save
        self._callbacks.init_end()
        self.cpu_plan: CpuPlan | None = None
        self.loop_options: dict[str, Any] = {}  # loop_cls's own keywords
        self._served: tuple[int, str | None] | None = None  # after train(): (version, LoRA prefix)

    def _task_maker(self, environment_factory: Any) -> Any:
        """What makes a row's prompt and reward besides the dataset's ``prompt`` and the
        reward functions (None: nothing): the environment factory. A row may lack ``prompt``
        only when something makes it."""
        return environment_factory

    # ----------------------------------------------------------------- public API

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Mapping[str, Any] | Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> TrainOutput:
        """Train until ``max_steps`` or ``num_train_epochs``; returns the last window.

        ``trial``: config values to apply before training, a dict or an optuna trial (its
        ``params``), so a sweep runs many configs from one trainer factory.

        Raises:
            TrainingInterrupted: SIGINT or SIGTERM stopped the run (the rollout process is
                stopped first); the message names the step and the last checkpoint.
        """
        refuse_top_level_run(f"calls {type(self).__name__}.train()")
        if ignore_keys_for_eval is not None:
            raise ValueError("ignore_keys_for_eval: AsyncGRPOTrainer has no evaluation loop")
        if trial is not None:
            self._apply_trial(trial)
        resume = resume_from_checkpoint or self.args.resume_from_checkpoint
        checkpoint = self._find_checkpoint(resume) if resume else None
        with (
            signals_interrupt(),
            failures_outrank_signals() as failing,
            cpus_shared_with_server(self.args, default_device()) as self.cpu_plan,
            Learner(
                self.model,
                self.args,
                peft_config=self.peft_config,
                optimizers=self.optimizers,
                max_model_len=lambda: ServerSettings.of(self.args).max_model_len(self.model_name),
            ) as learner,
        ):
            books = RunBooks.open(self._run_inputs(), learner, checkpoint)
            self._publisher.learner = learner
            self._served = None

            def failing_unless_interrupted(error: BaseException) -> None:
                """A part failed to start: name the error before the teardown, as the
                handlers below do (a signal that stopped the run is not named)."""
                if not isinstance(error, KeyboardInterrupt):
                    failing(error)

            run: TrainingRun | None = None  # built whole by start(), which closes it on failure
            try:
                run = TrainingRun.start(books, on_failure=failing_unless_interrupted)
                self._callbacks.train_begin(
                    optimizer=learner.optimizer,
                    lr_scheduler=learner.scheduler,
                    global_step=learner.step,
                    logging_steps=run.logging_every,
                    save_steps=run.save_every,
                    rank=learner.rank,
                    local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                )
                output = run.loop()
                self._publisher.final = FinalModel.of(learner, run.output_dir)
                self._served = (run.ledger.version, run.weights.lora_name)
                self._callbacks.train_end()
                return output
            except KeyboardInterrupt as error:
                raise self._interrupted(signum_of(error), learner.step) from None
            except BaseException as error:
                failing(error)  # a signal during the teardown must not hide why the run stopped
                raise
            finally:
                self._publisher.learner = None
                if run is not None:
                    run.close()

    def _run_inputs(self) -> RunInputs:
        return RunInputs(
            args=self.args,
            model_name=self.model_name,
            model_config=self.model.config,
            processing_class=self.processing_class,
            dataset=self.train_dataset,
            reward_funcs=tuple(self.reward_funcs),
            tools=tuple(self.tools),
            environment_factory=self.environment_factory,
            loop_cls=self.loop_cls,
            callbacks=self._callbacks,
            after_checkpoint=self._publisher.after_checkpoint,
            cpu_plan=self.cpu_plan,
            eval_datasets=self.eval_datasets,
            eval_reward_funcs=tuple(self.eval_reward_funcs),
            loop_options=self.loop_options,
        )

    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Evaluate held-out prompts now, on the vLLM servers, as transformers' ``evaluate``.

        ``eval_dataset`` (one dataset or a dict of named ones; default: the trainer's) is
        generated at the trainer's weights with the evaluation settings (``eval_temperature``,
        ``eval_num_generations``, ``eval_max_completion_length``) and scored by the reward
        functions. After ``train()`` the servers hold the trained weights (the last push); before
        it, the model's weights are pushed to them first (by disk). The metrics are
        ``<metric_key_prefix>/<name>/...`` (docs/evaluation.md); they go to the callbacks'
        ``on_evaluate`` too. Not from inside ``train()``: evaluations during training follow
        ``eval_strategy``.

        Raises:
            ValueError: no evaluation dataset, or a bad one; ``ignore_keys`` given.
            RuntimeError: called during ``train()``; the evaluation failed (the cause).
        """
        if ignore_keys is not None:
            raise ValueError(
                "ignore_keys: evaluations score with the reward functions; there "
                "are no model outputs to ignore"
            )
        if self._publisher.learner is not None:
            raise RuntimeError(
                "evaluate() inside train(): evaluations during training follow "
                "eval_strategy and eval_steps"
            )
        datasets = (
            self.eval_datasets
            if eval_dataset is None
            else eval_datasets_of(eval_dataset, self.environment_factory, self.args)
        )
        if not datasets:
            raise ValueError("evaluate() needs an eval_dataset (here or in the constructor)")
        version, lora = self._served or (
            push_to_servers(self.model, self.args, self.model_name, self.output_dir),
            None,
        )
        spec = attrs.evolve(
            evaluation_spec(self._run_inputs(), self.args), lora_name=lora, eval_datasets=datasets
        )
        outcome = evaluate_now(spec, version, step=self.state.global_step)
        if outcome.error:
            raise RuntimeError(f"the evaluation at version {version} failed: {outcome.error}")
        figures: dict[str, float] = {}
        for evaluation in outcome.evaluations:
            figures.update(evaluation_metrics(evaluation))
        figures = {metric_key_prefix + name.removeprefix("eval"): v for name, v in figures.items()}
        self._callbacks.evaluate(figures)
        return figures

    # ----------------------------------------------------------------- transformers' Trainer API

    @property
    def callback_handler(self) -> CallbackHandler:
        """transformers' ``CallbackHandler`` holding the callbacks."""
        return self._callbacks.handler

    @property
    def state(self) -> TrainerState:
        """The ``TrainerState`` the callbacks see (``global_step``, ``log_history``, ...)."""
        return self._callbacks.state

    def add_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        self._callbacks.handler.add_callback(callback)

    def pop_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> Any:
        return self._callbacks.handler.pop_callback(callback)

    def remove_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        self._callbacks.handler.remove_callback(callback)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the policy so ``from_pretrained`` loads it, with the tokenizer; rank 0 writes
        (:meth:`Publisher.save_model <asyncgrpo.shell.run.publishing.Publisher.save_model>`).
        Before ``train()`` it is the model as given; inside ``train()`` (a callback) the
        current policy (collective: every rank calls it); after ``train()`` the trained
        policy."""
        self._publisher.save_model(output_dir)

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """Save the model to ``output_dir`` and upload it to ``hub_model_id``
        (:meth:`Publisher.push_to_hub <asyncgrpo.shell.run.publishing.Publisher.push_to_hub>`);
        ``kwargs`` go to the model card."""
        return self._publisher.push_to_hub(commit_message, blocking, token, revision, **kwargs)

    def _apply_trial(self, trial: Mapping[str, Any] | Any) -> None:
        params = dict(trial) if isinstance(trial, Mapping) else dict(trial.params)
        known = field_names(type(self.args))
        for name in params:
            if name not in known:
                raise ValueError(
                    f"trial sets {name!r}, which is not an AsyncGRPOConfig field"
                    + did_you_mean(name, known)
                )
            if name in _FIXED_AT_CONSTRUCTION:
                raise ValueError(
                    f"trial sets {name!r}, which takes effect when the trainer is built (the "
                    "model is loaded): build a trainer per value"
                )
        self.args = dataclasses.replace(self.args, **params)
        self.output_dir = self.args.output_path
        self._callbacks.args = self.args
        self._publisher.args = self.args
        self._callbacks.state.trial_params = params
        seed_everything(self.args)

    def _interrupted(self, signum: int, step: int) -> TrainingInterrupted:
        of = f" of {self.args.max_steps}" if self.args.max_steps > 0 else ""
        last = checkpoints.latest(self.output_dir)
        where = (
            f"last checkpoint: {last} (resume with resume_from_checkpoint=True, or "
            "asyncgrpo train --resume)"
            if last
            else "no checkpoint was saved (save_steps)"
        )
        return TrainingInterrupted(
            signum, f"training interrupted by {signal_name(signum)} at step {step}{of}; {where}"
        )

    def _find_checkpoint(self, resume: str | bool) -> Path:
        if isinstance(resume, str):
            path = Path(resume)
            checkpoints.check_loads(path)  # CheckpointError naming the file that does not load
            return path
        return checkpoints.find_for_resume(self.output_dir)
