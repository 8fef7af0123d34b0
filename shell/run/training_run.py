"""One ``train()`` call of :class:`~asyncgrpo.shell.run.AsyncGRPOTrainer`: the step loop.

One step, on rank 0:

1. take the rollout process's messages: groups (their samples enter the step queue,
   :mod:`asyncgrpo.core.run.step_queue`, the prompt cursor records their outcome) and loop reports
   (metrics) until the queue is ready; the wait is ``perf/rollout_wait_s``. The queue drops
   samples more than ``max_staleness`` versions old (``sample/dropped_stale_count``) or longer
   than ``token_budget`` (``batch/dropped_oversize_count``) and keeps the next step planned;
   the rollout process learns which tokens are done with (trained or dropped) for its pacing;
2. take the planned step;
3. pack each row, scatter rows to the processes, run :meth:`Learner.train_step`;
4. every ``weight_sync_steps`` steps, push the weights to the vLLM server;
5. log a window every ``logging_steps`` steps, checkpoint every ``save_steps``.

Other ranks receive their rows from rank 0 and take part in the collective step, sync and
checkpoint. Training stops at ``max_steps`` (when > 0) or when ``num_train_epochs`` passes over
the prompts were consumed, counted in distinct prompts.

Its decisions live in core (step queue, cursor, schedule, metrics) and its other jobs in the
objects it holds: the :class:`~asyncgrpo.shell.run.intake.SampleIntake` (messages into the step
queue and the prompt cursor), the :class:`~asyncgrpo.shell.run.pushes.RunPushes` (each push,
and when servers need the weights again) and its
:class:`~asyncgrpo.shell.run.push_ledger.PushLedger` (the version the servers hold), the
:class:`~asyncgrpo.shell.run.spread_guard.SpreadGuard`, the
:class:`~asyncgrpo.shell.learner.Learner`,
the :class:`~asyncgrpo.shell.rollout.RolloutProcess` and the run's checkpoints and logs.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import attrs
import structlog
from transformers import TrainerControl

from asyncgrpo.adapters.process_group import decided_on_rank0, scattered_from_rank0
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.core import metrics
from asyncgrpo.core.rollout import cursor
from asyncgrpo.core.run import planner, schedule, step_queue
from asyncgrpo.core.weights.parity import STALENESS0_GAP
from asyncgrpo.shell.learner import Learner
from asyncgrpo.shell.rollout import LoopSpec, RolloutProcess
from asyncgrpo.shell.run import checkpoints
from asyncgrpo.shell.run.evaluations import Evaluations
from asyncgrpo.shell.run.flops import FlopsMeter
from asyncgrpo.shell.run.inputs import RunInputs
from asyncgrpo.shell.run.intake import SampleIntake
from asyncgrpo.shell.run.interrupts import interrupts_deferred
from asyncgrpo.shell.run.metrics_log import (
    EVALUATIONS_FILE,
    MetricsFile,
    WindowLog,
    drop_rows_after,
    write_positions,
)
from asyncgrpo.shell.run.nonfinite_guard import NonfiniteGuard
from asyncgrpo.shell.run.push_ledger import PushLedger
from asyncgrpo.shell.run.pushes import RunPushes
from asyncgrpo.shell.run.spread_guard import SpreadGuard
from asyncgrpo.shell.servers import (
    ServerSettings,
    SharedServers,
    VersionPin,
    check_servers_match,
    release_process,
)
from asyncgrpo.shell.weights import (
    ParityGuard,
    WeightPusher,
    WeightSync,
    open_weight_sync,
)

log = structlog.get_logger("asyncgrpo.trainer")
RESYNC = "resync"  # rank 0 to every rank: the server went away; push the weights again first
STEP = "step"  # rank 0 to every rank: a step follows; each rank's rows come by scatter
SPREADLESS = "spreadless"  # rank 0 to every rank: no reward spread left; checkpoint and stop


@attrs.frozen
class TrainOutput:
    """What :meth:`AsyncGRPOTrainer.train` returns (as transformers' TrainOutput)."""

    global_step: int
    training_loss: float
    metrics: dict[str, float]


class TrainingRun:
    """The state of one ``train()`` call (the shell's side; every decision is the core's)."""

    def __init__(self, inputs: RunInputs, learner: Learner, checkpoint: Path | None):
        self.inputs = inputs
        self.args = inputs.args
        self.learner = learner
        self.callbacks = inputs.callbacks
        self.rank0 = learner.rank == 0
        self.output_dir = Path(self.args.output_dir)
        self.window = metrics.MetricWindow()
        self.forwarded_total = 0
        self.last_loss = math.nan
        self.dataset_size = None if inputs.dataset is None else len(inputs.dataset)
        self.logging_every = max(
            1, schedule.interval_steps(self.args.logging_steps, self.args.max_steps)
        )
        self.save_every = schedule.interval_steps(self.args.save_steps, self.args.max_steps)
        saved = None
        if checkpoint is not None:
            learner.load_checkpoint(checkpoint)
            saved = checkpoints.load_rollout_state(checkpoint)
        evaluating = inputs.eval_datasets and self.args.eval_strategy == "steps"
        every = (
            self.args.eval_steps if self.args.eval_steps is not None else self.args.logging_steps
        )
        self.evaluations = Evaluations(
            schedule.interval_steps(every, self.args.max_steps) if evaluating else None,
            bool(inputs.eval_datasets) and self.args.eval_on_start,
            None if saved is None else saved.last_evaluated,
            on_metrics=self._evaluated,
        )
        self.pin = VersionPin() if self.rank0 else None
        self.process: RolloutProcess | None = None
        # rank 0: outages of each server and whom the weights were pushed to, from the first
        # push, and the version that landed on each
        self.servers = SharedServers(self.args.server_urls) if self.rank0 else None
        self.trust = self.servers.trusts[0] if self.servers is not None else None
        self.ledger = PushLedger(self._observe, self.servers, on_version=self.evaluations.landed)
        self.weights: WeightSync | None = None
        self.pushes: RunPushes | None = None
        self.window_log = WindowLog(self.output_dir, self.args.num_completions_to_print)
        self.flops: FlopsMeter | None = None
        self.step_flops = 0.0
        self.parity: ParityGuard | None = None
        self.spread = SpreadGuard(self.args.stop_after_spreadless_steps, self.args.num_generations)
        self.nonfinite = NonfiniteGuard(self.args, learner.step)
        self.intake = SampleIntake(
            cursor.PromptCursor() if saved is None else saved.cursor,
            lambda: self.learner.step,
            self._observe,
            self.spread,
            self.evaluations.outcome,
        )
        if saved is not None:
            self.intake.drop_split_groups(saved.split_groups)
        self.last_entropy = math.nan

    def start(self) -> None:
        """Connect to the servers (several: check that they can stand in for each other),
        push the trainer's weights, start the rollout process; what this opens, :meth:`close`
        closes, also when it fails half way."""
        self._check_servers()
        self.weights = open_weight_sync(
            self.learner, self.args, self.inputs.model_name, self.output_dir
        )
        self.weights.start()
        pusher = WeightPusher(
            self.weights,
            self.learner,
            self.servers,
            self._client,
            self.args.vllm_server_timeout,
            uninterruptible=interrupts_deferred,
            hold=None if self.pin is None else self.pin.hold,
        )
        self.pushes = RunPushes(
            pusher, self.weights, self.ledger, self.args, self.rank0, self.servers, self._observe
        )
        self.parity = ParityGuard.for_run(self.learner, self.args, self._client)
        if self.rank0:
            self.max_model_len = ServerSettings.of(self.args).max_model_len(self.inputs.model_name)
            self.token_budget = self.args.token_budget or self.max_model_len
            self.intake.queue = self._new_queue()
            self.output_dir.mkdir(parents=True, exist_ok=True)
            checkpoints.remove_partials(self.output_dir)
            if self.learner.step > 0:  # resumed: the steps after the checkpoint are trained again
                drop_rows_after(self.output_dir, self.learner.step)
            self.window_log.file = MetricsFile(self.output_dir)
            self.evaluations.file = MetricsFile(self.output_dir, EVALUATIONS_FILE)
            self.evaluations.started = time.monotonic()
        self.pushes.start(self.inputs.model_name)
        if self.rank0:
            self.flops = FlopsMeter(
                self.inputs.model_config, self.learner.device, self.learner.bf16
            )
            log.info(
                "mfu peak",
                peak_tflops=round(self.flops.peak_flops / 1e12, 4),
                source=self.flops.peak_source,
            )
            cpu_plan = self.inputs.cpu_plan
            self.process = RolloutProcess(
                self._loop_spec(),
                self.args.rollout_worker_timeout,
                self.trust,
                self.servers,
                pin=self.pin,
                restarts=self.args.rollout_worker_restarts,  # from the trainer's prompt cursor
                resume_cursor=lambda: self.intake.cursor,
                on_start=lambda pid: release_process(pid, cpu_plan),
            )
            self.ledger.process = self.intake.process = self.process
            self.process.start()
            for server in range(len(self.args.server_urls)):
                self.process.set_server_version(server, self.ledger.version)
            self.process.set_model_version(self.ledger.version)
            self.process.set_steps_taken(self.learner.step)
            self.evaluations.process = self.process
            self.evaluations.landed(self.ledger.version, at_start=True)
            self.window_log.open_bar(
                self.learner.step, self.args.max_steps, bool(self.args.disable_tqdm)
            )

    def _new_queue(self) -> step_queue.StepQueue:
        return step_queue.StepQueue(
            step_queue.QueueSettings(
                self.token_budget,
                self.learner.world_size,
                self.args.gradient_accumulation_steps,
                self.args.max_staleness,
            )
        )

    def _check_servers(self) -> None:
        """Several servers: rank 0 checks that each can stand in for the first
        (:func:`~asyncgrpo.shell.servers.check_servers_match`); every process raises the
        mismatch, naming the server and the flag."""
        if len(self.args.server_urls) < 2:
            return
        decided_on_rank0(
            lambda: check_servers_match(
                ServerSettings.of(self.args),
                self.inputs.model_name,
                self.args.top_k > 0 or self.args.top_p < 1.0,
            ),
            refusals=(ValueError,),
        )

    def _client(self, server: int = 0, **options: Any) -> VLLMClient:
        return ServerSettings.of(self.args).client(self.inputs.model_name, server, **options)

    def _loop_spec(self) -> LoopSpec:
        given = self.inputs
        return LoopSpec(
            loop_cls=given.loop_cls,
            config=self.args,
            model_name=given.model_name,
            dataset=given.dataset,
            reward_funcs=given.reward_funcs,
            processing_class=given.processing_class,
            max_model_len=self.max_model_len,
            token_budget=self.token_budget,
            rows_per_step=self.args.gradient_accumulation_steps * self.learner.world_size,
            tools=given.tools,
            environment_factory=given.environment_factory,
            start_cursor=self.intake.cursor,
            lora_name=self.weights.lora_name if self.weights is not None else None,
            eval_datasets=given.eval_datasets,
            eval_reward_funcs=given.eval_reward_funcs,
            loop_options=given.loop_options,
        )

    # ----------------------------------------------------------------- the loop

    def loop(self) -> TrainOutput:
        """Train step by step. A step's time runs from the end of the previous step's weight
        sync to the end of its own, so the previous step's logging and checkpoint are in it
        (``perf/logging_s``, ``perf/checkpoint_s``) and the ``perf/*`` parts add up to
        ``perf/step_s`` (docs/metrics.md)."""
        summary: dict[str, float] = {}
        step_start, after_step = time.monotonic(), (0.0, 0.0)
        epochs_before = self._epochs()
        while True:
            rows = self._next_rows()
            if rows is None:
                break
            self.callbacks.step_begin()
            out = self.learner.train_step(rows)
            if self.parity is not None:
                self.parity.check(out.metrics.get(STALENESS0_GAP), self.learner.step)
            self.last_loss = out.metrics.get("loss", math.nan)
            self.window = metrics.merge(self.window, out.window)
            if self.nonfinite.after_step(out, self.intake):  # diverged: keep the last finite
                self._write_positions()
                self._save_checkpoint()  # the learner's weights: the last finite step's
                self._log_window()
                raise self.nonfinite.error(out, self.output_dir, self.learner.step)
            self.last_entropy = out.metrics.get("entropy", math.nan)
            sync_start = time.monotonic()
            if self.learner.step % self.args.weight_sync_steps == 0:
                assert self.pushes is not None
                self.pushes.after_step()
            step_end = time.monotonic()
            self.ledger.record_landed()
            fwd_bwd_s = out.metrics.get("perf/fwd_bwd_s")
            self._observe(
                metrics.mean("perf/weight_sync_s", step_end - sync_start),
                metrics.mean("perf/logging_s", after_step[0]),
                metrics.mean("perf/checkpoint_s", after_step[1]),
                metrics.mean("perf/step_s", step_end - step_start),
                *(
                    self.flops.mfu(self.step_flops, fwd_bwd_s, self.learner.world_size)
                    if self.flops is not None
                    else ()
                ),
            )
            self.window_log.step_done()
            epochs_after = self._epochs()
            save = schedule.due(
                self.args.save_strategy.value,
                self.learner.step,
                self.save_every,
                epochs_before,
                epochs_after,
            )
            if self._close_spread_step():  # no reward spread left for stop_after_spreadless_steps
                self.callbacks.control.should_training_stop = True
                save = True
            control = self._agree(
                self.callbacks.step_end(
                    self.learner.step,
                    epochs_after,
                    self._log_due(epochs_before, epochs_after),
                    save,
                )
            )
            if control.should_training_stop or self._finished():
                self._await_pushes()  # the last step's window holds the last push
            self._write_positions()
            if control.should_log:
                summary = self._log_window()
            logged = time.monotonic()
            if control.should_save:
                self._save_checkpoint()
                self.inputs.after_checkpoint(self.learner.step, self.rank0)
                self.callbacks.save()
            step_start = step_end  # the next step holds this one's logging and checkpoint
            after_step = (logged - step_end, time.monotonic() - logged)
            if control.should_training_stop:
                break
            epochs_before = epochs_after
        self._await_pushes()
        if len(self.window):
            summary = self._log_window()
        with interrupts_deferred():
            self.learner.export.save_pretrained(self.output_dir, self.inputs.processing_class)
        if self.parity is not None:  # a run that sampled foreign weights is not a success
            self.parity.after_training(self.learner.step, str(self.output_dir))
        return TrainOutput(self.learner.step, self.last_loss, summary)

    def _agree(self, control: TrainerControl) -> TrainerControl:
        """Rank 0's ``should_log``/``should_save``/``should_training_stop`` on every rank."""
        control.should_log, control.should_save, control.should_training_stop = decided_on_rank0(
            lambda: (control.should_log, control.should_save, control.should_training_stop)
        )
        return control

    def _epochs(self) -> float:
        """Passes over the prompts consumed so far (0 without a dataset)."""
        if not self.dataset_size:
            return 0.0
        return cursor.epochs_consumed(self.intake.cursor, self.dataset_size)

    def _log_due(self, epochs_before: float, epochs_after: float) -> bool:
        step = self.learner.step
        first = self.args.logging_first_step and step == 1
        return first or schedule.due(
            self.args.logging_strategy.value, step, self.logging_every, epochs_before, epochs_after
        )

    def _observe(self, *observations: metrics.Observation) -> None:
        self.window = metrics.record(self.window, observations)

    def _finished(self) -> bool:
        if self.args.max_steps > 0:
            return self.learner.step >= self.args.max_steps
        return self.dataset_size is not None and self._epochs() >= self.args.num_train_epochs

    def _next_rows(self) -> list[Any] | None:
        """This process's rows of the next step, or None when training is over (collective).

        Rank 0 first broadcasts what comes next (:data:`STEP`, :data:`RESYNC` or None), then
        scatters the step so that each process receives only its own rows. While the
        server's weights are unknown (it went away), every process first takes part in
        pushing them again; the time that took, and the wait for samples that ended in it, is
        the step's ``perf/resync_s``."""
        started = time.monotonic()
        while True:
            plan_began = time.monotonic()
            step: planner.PackedStep | str | None = None
            if self.rank0 and not self._finished():
                step = self._plan_next_step()
            send_start = time.monotonic()
            assert self.pushes is not None
            what = STEP if isinstance(step, planner.PackedStep) else step
            told = (what, self.pushes.resync_servers)
            control = decided_on_rank0(lambda told=told: told)  # rank 0's, on every rank
            if control[0] != RESYNC:
                break
            self.pushes.resync(control[1])
        if control[0] == SPREADLESS:  # ended for lack of reward spread: keep where it stopped
            self._write_positions()
            self._save_checkpoint()
            return None
        if control[0] is None:
            return None
        rows = self._scatter(step if isinstance(step, planner.PackedStep) else None)
        self._observe(
            metrics.mean("perf/send_s", time.monotonic() - send_start),
            metrics.mean("perf/resync_s", plan_began - started),
        )
        return rows

    def _scatter(self, step: planner.PackedStep | None) -> list[Any]:
        """Rank ``r``'s row of every micro-batch of ``step`` (given on rank 0 only)."""
        world = self.learner.world_size
        per_rank = (
            None if step is None else [[mb[r] for mb in step.micro_batches] for r in range(world)]
        )
        return scattered_from_rank0(per_rank)

    def _plan_next_step(self) -> planner.PackedStep | str:
        """Wait until the step queue is ready, take its step and pack the rows (rank 0);
        :data:`RESYNC` instead when the server went away and the weights must be pushed."""
        intake = self.intake
        assert self.process is not None and intake.queue is not None
        waited_from, intake.waited_s = time.monotonic(), 0.0
        if self.pushes is not None and self.pushes.servers_back():
            return RESYNC
        intake.apply(step_queue.advance(intake.queue, self.learner.step))
        intake.drain(wait_s=0.0)

        def ready() -> bool:
            return step_queue.ready(
                intake.queue,
                self.process.in_flight(),
                behind=self.learner.step - self.ledger.version,
            )

        while True:
            while not ready():
                if (interrupted := self._wait_for_samples()) is not None:
                    return interrupted
            # announce the step, then look again: the rollout loop reports a group in flight
            # before its last look at the steps taken, so a group it admitted against the old
            # count shows here, and is waited for instead of arriving stale (step_queue.ready:
            # a short step waits for any group in flight, a full one for older ones)
            self.process.set_steps_taken(self.learner.step + 1)
            if ready():
                break
            if (interrupted := self._wait_for_samples()) is not None:
                self.process.set_steps_taken(self.learner.step)
                return interrupted
        step = intake.take_step()
        self.spread.groups_per_step = len({s.group_id for s in step.samples})
        pack_start = time.monotonic()
        self._observe(
            metrics.mean("perf/rollout_wait_s", intake.waited_s),
            metrics.mean("perf/plan_s", pack_start - waited_from - intake.waited_s),
            metrics.mean("rollout/queue_size", len(step.queue.buffer)),
            metrics.total("sample/dropped_stale_count", 0),
        )
        packed = planner.pack_step(step.micro_batches)
        self.forwarded_total += packed.forwarded_tokens
        intake.trained(step.samples)
        self._observe(
            *planner.step_observations(
                packed, self.learner.step, time.monotonic(), self.token_budget
            )
        )
        if self.flops is not None:
            self.step_flops = self.flops.of_rows(packed.rows)
        self._observe(metrics.mean("perf/pack_s", time.monotonic() - pack_start))
        return packed

    def _wait_for_samples(self) -> str | None:
        """Wait a moment for the rollout process's messages; :data:`RESYNC` or
        :data:`SPREADLESS` when the step must not be taken now (else None). Raises when the
        push thread found the server frozen."""
        if self.pushes is not None:
            assert self.process is not None
            self.pushes.pusher.raise_if_silent()  # the push thread found the server frozen
            if self.pushes.resync_due(self.process):
                return RESYNC
        self.intake.drain(wait_s=0.2)
        if self.spread.step_due() and self._close_spread_step():
            return SPREADLESS
        return None

    def _write_positions(self) -> None:
        """Write the positions done with since the last row, as the current step's row: at
        every step's end, before its checkpoint, so a checkpoint's cursor and the rows up to
        its step tell the same positions."""
        done = self.intake.take_done()
        if self.rank0 and done:
            write_positions(self.output_dir, self.learner.step, done)

    # ----------------------------------------------------------------- weights and logs

    def _await_pushes(self) -> None:
        """Rank 0: wait until the server holds the weights of every push made (the run's end)
        and the evaluation asked for meanwhile has arrived, and record them."""
        if self.pushes is not None:
            self.pushes.wait_landed()
        if self.process is not None and self.intake.queue is not None:
            self.evaluations.wait_for_last(self.intake.drain, self.args.rollout_worker_timeout)
        if len(self.window):  # else the last window was logged: nothing joins it now
            self.ledger.record_landed()

    def _close_spread_step(self) -> bool:
        """Rank 0: close the spread guard's step; whether the run must stop for lack of reward
        spread (``stop_after_spreadless_steps``)."""
        return self.rank0 and self.spread.close_step(self.learner.step, self.last_entropy)

    def _log_window(self) -> dict[str, float]:
        """Log the window (:class:`~asyncgrpo.shell.run.metrics_log.WindowLog`) and hand its
        summary to the callbacks."""
        extra = {"num_tokens": float(self.forwarded_total)}
        if self.dataset_size:
            extra = {"epoch": self._epochs(), **extra}
        summary = self.window_log.write(
            self.learner.step, self.window, extra, self.intake.completions
        )
        self.window = metrics.MetricWindow()
        self.intake.completions = []
        self.callbacks.log(summary)
        return summary

    def _evaluated(self, version: int, figures: dict[str, float]) -> None:
        """Rank 0: an evaluation of ``version`` arrived; it is logged at step ``version``."""
        self.window_log.evaluation(version, figures)
        self.callbacks.evaluate(figures, step=version)

    def _save_checkpoint(self) -> None:
        checkpoints.save_run(
            self.output_dir,
            self.learner,
            rank0=self.rank0,
            keep=self.args.save_total_limit,
            model_name=self.inputs.model_name,
            cursor=self.intake.cursor,
            version=self.ledger.version,
            last_evaluated=self.evaluations.completed,
        )

    def close(self) -> None:
        self.evaluations.release()  # a push held for an evaluation goes now
        if self.pushes is not None:
            self.pushes.close()
        if self.process is not None:
            self.process.stop()
        if self.weights is not None:
            self.weights.close()
        self.window_log.close()
        if self.evaluations.file is not None:
            self.evaluations.file.close()
