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

import copy
import functools
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import structlog
from transformers import TrainerControl
from transformers.trainer_utils import IntervalStrategy, SaveStrategy

from asyncgrpo.adapters.process_group import decided_on_rank0, scattered_from_rank0
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.core import metrics
from asyncgrpo.core.records import TrainingSample
from asyncgrpo.core.rollout import cursor
from asyncgrpo.core.rollout.metrics import stale_drops_by_length
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
    stop_event_loop,
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


class OpenWindow:
    """The run's metric window since the last logged one: the run and its parts record into it,
    the step loop logs and empties it every ``logging_steps``."""

    def __init__(self) -> None:
        self.window = metrics.MetricWindow()

    def observe(self, *observations: metrics.Observation) -> None:
        """Record ``observations`` in the open window."""
        self.window = metrics.record(self.window, observations)


@attrs.frozen
class RunBooks:
    """What one ``train()`` call keeps its accounts in, made before anything starts (no
    process, thread, connection or file of the run's is open yet; :meth:`open` loads the
    checkpoint into the learner).

    Attributes:
        inputs: what the run takes of its trainer.
        learner: the trainer's model and optimizer, set up.
        open_window: the metrics since the last logged window.
        window_log: writes each logged window (its file opens when the run starts).
        evaluations: when evaluations are due and what came of them.
        servers: rank 0's records of the run's servers, shared with the rollout process
            (None on other ranks).
        pin: rank 0's pin of the version an evaluation reads (None on other ranks).
        ledger: the version each server holds.
        spread: stops the run when no reward spread is left.
        nonfinite: stops the run on a non-finite step.
        intake: the rollout process's messages into the step queue and the prompt cursor.
        restored: the samples the checkpoint resumed from kept queued, put back on the queue
            when it is made (rank 0; empty otherwise).
    """

    inputs: RunInputs
    learner: Learner
    open_window: OpenWindow
    window_log: WindowLog
    evaluations: Evaluations
    servers: SharedServers | None
    pin: VersionPin | None
    ledger: PushLedger
    spread: SpreadGuard
    nonfinite: NonfiniteGuard
    intake: SampleIntake
    restored: tuple[TrainingSample, ...] = ()

    @classmethod
    def open(cls, inputs: RunInputs, learner: Learner, checkpoint: Path | None) -> RunBooks:
        """The books of a fresh run (``checkpoint`` None), or of one resumed from
        ``checkpoint``: its learner state is loaded into ``learner`` and its rollout state
        (prompt cursor, groups split by the save, the last evaluation) into the books.

        Raises:
            CheckpointError: the checkpoint does not load (names the file).
        """
        args = inputs.args
        rank0 = learner.rank == 0
        saved = None
        if checkpoint is not None:
            learner.load_checkpoint(checkpoint)
            saved = checkpoints.load_rollout_state(checkpoint)
        open_window = OpenWindow()
        window_log = WindowLog(args.output_path, args.num_completions_to_print)

        def evaluated(version: int, figures: dict[str, float]) -> None:
            """Rank 0: an evaluation of ``version`` arrived; it is logged at step ``version``."""
            window_log.evaluation(version, figures)
            inputs.callbacks.evaluate(figures, step=version)

        evaluating = inputs.eval_datasets and args.eval_strategy == "steps"
        every = args.eval_steps if args.eval_steps is not None else args.logging_steps
        evaluations = Evaluations(
            schedule.interval_steps(every, args.max_steps) if evaluating else None,
            bool(inputs.eval_datasets) and args.eval_on_start,
            None if saved is None else saved.last_evaluated,
            on_metrics=evaluated,
        )
        # rank 0: outages of each server and whom the weights were pushed to, from the first
        # push, and the version that landed on each
        servers = SharedServers(args.server_urls) if rank0 else None
        ledger = PushLedger(open_window.observe, servers, on_version=evaluations.landed)
        spread = SpreadGuard(args.stop_after_spreadless_steps, args.num_generations)
        intake = SampleIntake(
            cursor.PromptCursor() if saved is None else saved.cursor,
            lambda: learner.step,
            open_window.observe,
            spread,
            evaluations.outcome,
            args.max_completion_length,
        )
        if saved is not None:
            intake.drop_split_groups(saved.split_groups)
        restored = saved.queued if saved is not None and saved.queued and rank0 else ()
        return cls(
            inputs,
            learner,
            open_window,
            window_log,
            evaluations,
            servers,
            VersionPin() if rank0 else None,
            ledger,
            spread,
            NonfiniteGuard(args, learner.step),
            intake,
            restored,
        )


@attrs.frozen
class RolloutSide:
    """Rank 0's started parts of a run: the rollout process and what the steps it feeds are
    measured against.

    Attributes:
        process: the rollout process, started.
        flops: the model FLOPs of the rows and the device's peak (``perf/fwd_bwd_mfu``).
        token_budget: a packed row's tokens (``token_budget``, else the server's
            ``max_model_len``).
    """

    process: RolloutProcess
    flops: FlopsMeter
    token_budget: int


@attrs.frozen
class RunParts:
    """The parts :meth:`TrainingRun.start` starts, on every rank.

    Attributes:
        weights: the weight sync path, started.
        pushes: the run's pushes (the push at start made).
        parity: the check that the servers serve the trainer's weights.
        rollout: the rollout side (rank 0; None on other ranks, which have none).
    """

    weights: WeightSync
    pushes: RunPushes
    parity: ParityGuard
    rollout: RolloutSide | None


def _tear_down(
    books: RunBooks,
    pushes: RunPushes | None,
    process: RolloutProcess | None,
    weights: WeightSync | None,
) -> None:
    """Close what a run started, in this order (each given part; None: not started): release
    a push held for an evaluation, let the push in flight land and stop watching the servers,
    stop the rollout process, close the sync path, close the logs, end the event loop of the
    calls to the servers (:func:`~asyncgrpo.shell.servers.bridge.stop_event_loop`)."""
    books.evaluations.release()  # a push held for an evaluation goes now
    if pushes is not None:
        pushes.close()
    if process is not None:
        process.stop()
    if weights is not None:
        weights.close()
    books.window_log.close()
    if books.evaluations.file is not None:
        books.evaluations.file.close()
    stop_event_loop()


def new_step_queue(token_budget: int, learner: Learner, args: Any) -> step_queue.StepQueue:
    """An empty step queue of rows of ``token_budget`` tokens, one per process and
    accumulation step (``gradient_accumulation_steps``), dropping samples more than
    ``max_staleness`` versions old."""
    return step_queue.StepQueue(
        step_queue.QueueSettings(
            token_budget,
            learner.world_size,
            args.gradient_accumulation_steps,
            args.max_staleness,
        )
    )


class TrainingRun:
    """The state of one ``train()`` call (the shell's side; every decision is the core's),
    built whole: :meth:`start` starts its parts and returns it; :meth:`close` closes them."""

    def __init__(self, books: RunBooks, parts: RunParts) -> None:
        inputs, learner = books.inputs, books.learner
        self.inputs = inputs
        self.args = inputs.args
        self.learner = learner
        self.callbacks = inputs.callbacks
        self.rank0 = learner.rank == 0
        self.output_dir = self.args.output_path
        self.books = books
        self.open_window = books.open_window
        self.forwarded_total = 0
        self.last_loss = math.nan
        self.dataset_size = None if inputs.dataset is None else len(inputs.dataset)
        self.logging_every = max(
            1, schedule.interval_steps(self.args.logging_steps, self.args.max_steps)
        )
        self.save_every = schedule.interval_steps(self.args.save_steps, self.args.max_steps)
        self.evaluations = books.evaluations
        self.servers = books.servers
        self.ledger = books.ledger
        self.window_log = books.window_log
        self.spread = books.spread
        self.nonfinite = books.nonfinite
        self.intake = books.intake
        self.weights = parts.weights
        self.pushes = parts.pushes
        self.parity = parts.parity
        self.rollout = parts.rollout
        self.step_flops = 0.0
        self.last_entropy = math.nan

    @classmethod
    def start(
        cls,
        books: RunBooks,
        on_failure: Callable[[BaseException], None] = lambda error: None,
    ) -> TrainingRun:
        """Connect to the servers (several: check that they can stand in for each other),
        push the trainer's weights, start the rollout process (rank 0), and return the run
        holding them.

        When a part fails to start, ``on_failure`` is called with the error (the trainer's
        ``failing``: a signal during the teardown must not hide it), then the parts started
        before it are closed (as :meth:`close` closes them) and the error is raised: nothing
        is left running."""
        inputs, learner = books.inputs, books.learner
        args = inputs.args
        rank0 = learner.rank == 0
        output_dir = args.output_path
        pin, servers = books.pin, books.servers
        evaluations, intake = books.evaluations, books.intake

        def client(server: int = 0, **options: Any) -> VLLMClient:
            return ServerSettings.of(args).client(inputs.model_name, server, **options)

        weights: WeightSync | None = None
        pushes: RunPushes | None = None
        process: RolloutProcess | None = None
        try:
            _check_servers(inputs)
            weights = open_weight_sync(learner, args, inputs.model_name, output_dir)
            weights.start()
            pusher = WeightPusher(
                weights,
                learner,
                servers,
                client,
                args.vllm_server_timeout,
                uninterruptible=interrupts_deferred,
                hold=None if pin is None else pin.hold,
            )
            pushes = RunPushes(
                pusher, weights, books.ledger, args, rank0, servers, books.open_window.observe
            )
            parity = ParityGuard.for_run(learner, args, client)
            max_model_len = token_budget = 0
            if rank0:
                max_model_len = ServerSettings.of(args).max_model_len(inputs.model_name)
                token_budget = args.token_budget or max_model_len
                intake.queue = new_step_queue(token_budget, learner, args)
                if books.restored:  # the queued samples of the checkpoint resumed from
                    intake.restore(books.restored)
                output_dir.mkdir(parents=True, exist_ok=True)
                checkpoints.remove_partials(output_dir)
                if learner.step > 0:  # resumed: the steps after the checkpoint are trained again
                    drop_rows_after(output_dir, learner.step)
                books.window_log.file = MetricsFile(output_dir)
                evaluations.file = MetricsFile(output_dir, EVALUATIONS_FILE)
                evaluations.started = time.monotonic()
            pushes.start(inputs.model_name)
            if not rank0:
                return cls(books, RunParts(weights, pushes, parity, None))
            assert servers is not None  # rank 0 keeps the servers' records
            flops = FlopsMeter(inputs.model_config, learner.device, learner.bf16)
            log.info(
                "mfu peak",
                peak_tflops=round(flops.peak_flops / 1e12, 4),
                source=flops.peak_source,
            )
            cpu_plan = inputs.cpu_plan
            process = RolloutProcess(
                _loop_spec(inputs, learner, max_model_len, token_budget, intake, weights),
                args.rollout_worker_timeout,
                servers.trusts[0],
                servers,
                pin=pin,
                restarts=args.rollout_worker_restarts,  # from the trainer's prompt cursor
                resume_cursor=lambda: intake.cursor,
                on_start=lambda pid: release_process(pid, cpu_plan),
            )
            books.ledger.process = intake.process = process
            process.start()
            for server in range(len(args.server_urls)):
                process.set_server_version(server, books.ledger.version)
            process.set_model_version(books.ledger.version)
            process.set_steps_taken(learner.step)
            evaluations.process = process
            evaluations.landed(books.ledger.version, at_start=True)
            books.window_log.open_bar(learner.step, args.max_steps, bool(args.disable_tqdm))
            rollout = RolloutSide(process, flops, token_budget)
            return cls(books, RunParts(weights, pushes, parity, rollout))
        except BaseException as error:
            on_failure(error)
            _tear_down(books, pushes, process, weights)
            raise

    @property
    def window(self) -> metrics.MetricWindow:
        """The metrics since the last logged window."""
        return self.open_window.window

    @window.setter
    def window(self, window: metrics.MetricWindow) -> None:
        self.open_window.window = window

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
                    self.rollout.flops.mfu(self.step_flops, fwd_bwd_s, self.learner.world_size)
                    if self.rollout is not None
                    else ()
                ),
            )
            self.window_log.step_done()
            epochs_after = self._epochs()
            save = schedule.due(
                SaveStrategy(self.args.save_strategy).value,
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
        # a run that sampled foreign weights is not a success
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
            IntervalStrategy(self.args.logging_strategy).value,
            step,
            self.logging_every,
            epochs_before,
            epochs_after,
        )

    def _observe(self, *observations: metrics.Observation) -> None:
        self.open_window.observe(*observations)

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
            if self.rollout is not None and not self._finished():
                step = self._plan_next_step(self.rollout)
            send_start = time.monotonic()
            what = STEP if isinstance(step, planner.PackedStep) else step
            told = (what, self.pushes.resync_servers)
            control = decided_on_rank0(functools.partial(copy.copy, told))  # rank 0's, on all
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

    def _plan_next_step(self, rollout: RolloutSide) -> planner.PackedStep | str:
        """Wait until the step queue is ready, take its step and pack the rows (rank 0);
        :data:`RESYNC` instead when the server went away and the weights must be pushed."""
        intake, process = self.intake, rollout.process
        waited_from, intake.waited_s = time.monotonic(), 0.0
        if self.pushes.servers_back():
            return RESYNC
        assert intake.queue is not None  # rank 0 made it when the run opened
        intake.apply(step_queue.advance(intake.queue, self.learner.step))
        intake.drain(wait_s=0.0)

        def ready() -> bool:
            assert intake.queue is not None
            return step_queue.ready(
                intake.queue,
                process.in_flight(),
                behind=self.learner.step - self.ledger.version,
            )

        while True:
            while not ready():
                if (interrupted := self._wait_for_samples(process)) is not None:
                    return interrupted
            # announce the step, then look again: the rollout loop reports a group in flight
            # before its last look at the steps taken, so a group it admitted against the old
            # count shows here, and is waited for instead of arriving stale (step_queue.ready:
            # a short step waits for any group in flight, a full one for older ones)
            process.set_steps_taken(self.learner.step + 1)
            if ready():
                break
            if (interrupted := self._wait_for_samples(process)) is not None:
                process.set_steps_taken(self.learner.step)
                return interrupted
        step = intake.take_step()
        self.spread.groups_per_step = len({s.group_id for s in step.samples})
        pack_start = time.monotonic()
        self._observe(
            metrics.mean("perf/rollout_wait_s", intake.waited_s),
            metrics.mean("perf/plan_s", pack_start - waited_from - intake.waited_s),
            metrics.mean("rollout/queue_size", len(step.queue.buffer)),
            metrics.total("sample/dropped_stale_count", 0),
            *stale_drops_by_length([], self.args.max_completion_length),
        )
        packed = planner.pack_step(step.micro_batches)
        self.forwarded_total += packed.forwarded_tokens
        intake.trained(step.samples)
        self._observe(
            *planner.step_observations(
                packed,
                self.learner.step,
                time.monotonic(),
                rollout.token_budget,
                self.args.max_completion_length,
            )
        )
        self.step_flops = rollout.flops.of_rows(packed.rows)
        self._observe(metrics.mean("perf/pack_s", time.monotonic() - pack_start))
        return packed

    def _wait_for_samples(self, process: RolloutProcess) -> str | None:
        """Wait a moment for the rollout process's messages; :data:`RESYNC` or
        :data:`SPREADLESS` when the step must not be taken now (else None). Raises when the
        push thread found the server frozen."""
        self.pushes.pusher.raise_if_failed()  # the push thread failed (the server frozen)
        if self.pushes.resync_due(process):
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
        self.pushes.wait_landed()
        if self.rollout is not None:
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
            queued=self.intake.queue.buffer if self.intake.queue is not None else (),
        )

    def close(self) -> None:
        """Close what :meth:`start` started (:func:`_tear_down`)."""
        _tear_down(
            self.books,
            self.pushes,
            None if self.rollout is None else self.rollout.process,
            self.weights,
        )


def _check_servers(inputs: RunInputs) -> None:
    """Several servers: rank 0 checks that each can stand in for the first
    (:func:`~asyncgrpo.shell.servers.check_servers_match`); every process raises the
    mismatch, naming the server and the flag."""
    args = inputs.args
    if len(args.server_urls) < 2:
        return
    decided_on_rank0(
        lambda: check_servers_match(
            ServerSettings.of(args),
            inputs.model_name,
            args.top_k > 0 or args.top_p < 1.0,
        ),
        refusals=(ValueError,),
    )


def _loop_spec(
    given: RunInputs,
    learner: Learner,
    max_model_len: int,
    token_budget: int,
    intake: SampleIntake,
    weights: WeightSync,
) -> LoopSpec:
    """What the rollout process runs: the trainer's inputs, the server's ``max_model_len``
    and the step's ``token_budget`` (tokens), from the intake's prompt cursor."""
    args = given.args
    return LoopSpec(
        loop_cls=given.loop_cls,
        config=args,
        model_name=given.model_name,
        dataset=given.dataset,
        reward_funcs=given.reward_funcs,
        processing_class=given.processing_class,
        max_model_len=max_model_len,
        token_budget=token_budget,
        rows_per_step=args.gradient_accumulation_steps * learner.world_size,
        tools=given.tools,
        environment_factory=given.environment_factory,
        start_cursor=cursor.restart_cursor(intake.cursor),  # queued positions are not generated
        lora_name=weights.lora_name,
        eval_datasets=given.eval_datasets,
        eval_reward_funcs=given.eval_reward_funcs,
        loop_options=given.loop_options,
    )
