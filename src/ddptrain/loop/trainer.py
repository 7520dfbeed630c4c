"""Trainer: fit / train_step / evaluate.

`fit` reads top to bottom. What varies sits behind small objects: the task (what a step computes), the
parallel wrapper (how the model is replicated), the step runner (the numerics of one step: step.py), the
parts of the run a checkpoint holds (checkpointed.py), the evaluator, the final weights (finish.py). Nothing
in a step waits for the device except at log steps: metrics accumulate in device tensors and are read once
per `--log_interval`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Iterator

import torch

import ddptrain
from ddptrain.checkpoints.format import Position
from ddptrain.checkpoints.manager import CheckpointManager
from ddptrain.config import TrainConfig
from ddptrain.data.pipeline import BatchLayout, epoch_batches
from ddptrain.data.streams import stream_batches
from ddptrain.errors import Preempted
from ddptrain.faults import FaultInjector
from ddptrain.loop.callbacks import TrainingRun, run_callbacks
from ddptrain.loop.checkpointed import (CallbackState, DataState, LogState, LoopState, ModelState, OptimState,
                                        RngState)
from ddptrain.loop.evaluator import Evaluator
from ddptrain.loop.finish import FinalWeights
from ddptrain.loop.loaders import build_loaders
from ddptrain.loop.optim import build_optimizer, build_scheduler, parameter_groups, peak_lr
from ddptrain.loop.plugins import plugged
from ddptrain.loop.preempt import StopSignals
from ddptrain.loop.sanity import check_first_batch, plugin_names
from ddptrain.loop.state import MetricWindow, seed_rank_rngs
from ddptrain.loop.step import SampleLog, StepRunner, StepServices, make_autocast
from ddptrain.loop.train_log import Clock, TrainLog
from ddptrain.models import hf, instantiate
from ddptrain.observe import perf
from ddptrain.observe.metrics import MetricSinks, ProgressBar
from ddptrain.observe.profiler import StepProfiler
from ddptrain.observe.trackers import Trackers
from ddptrain.parallel.distributed import DistributedContext, LaggedVote
from ddptrain.parallel.strategies import build_parallel, warn_unsynced_batchnorm
from ddptrain.parallel.watchdog import Watchdog
from ddptrain.parts import Parts

__all__ = ["Trainer", "build_optimizer"]
log = logging.getLogger("ddptrain")


class Trainer:
    """One process's part of a job. What `parts` (api.Parts: the Python API's own model, data, task, collate,
    optimizer and schedule) leaves None is what the config names."""

    def __init__(self, cfg: TrainConfig, ctx: DistributedContext, run_dir: Path, parts: Parts | None = None,
                 watchdog: Watchdog | None = None):
        """`watchdog`: the worker's, running since the process joined the job (api.train_worker); without one the
        Trainer builds its own, which `fit` runs."""
        self.cfg, self.ctx, self.run_dir = cfg, ctx, run_dir
        # --max_time counts from the launch; where no launcher set its time, from here.
        self.signals = StopSignals(cfg.max_time)
        self.injector = FaultInjector(cfg.inject_fault, ctx.rank, interrupted=lambda: self.signals.received is not None)
        self._own_watchdog = watchdog is None
        self.watchdog = watchdog or Watchdog.of_run(cfg.section("parallel"), ctx, run_dir)
        self.injector.at_startup()
        parts, data, training = parts or Parts(), cfg.section("data"), cfg.section("training")
        built = plugged(cfg, parts)  # the task, data and model the config names where the user's code gave none
        self.task, (train_ds, eval_ds) = built.task, built.datasets
        # Data first: its size decides the schedule. Global batch = micro batch x data-parallel ranks x accumulation.
        layout = BatchLayout(cfg.batch_size, ctx.dp_size, cfg.grad_accum_steps)
        self.data = build_loaders(data, training, ctx, layout, train_ds, eval_ds, parts.collate_fn)
        # The model, identical on every rank (DDP would broadcast rank 0's anyway), LoRA's adapters injected; on
        # the meta device under fsdp/hsdp, --tp too (each rank fills its tp split's FSDP shard: parallel/materialize).
        self.watchdog.phase("load")  # its weights come in: from files, or the seeded init (fsdp: after sharding)
        self.injector.at_load(0)
        on_meta = cfg.strategy != "ddp"
        self.module = module = instantiate(data, cfg.section("finetune"), built.model, ctx.device, seed=cfg.seed,
                                           sharded=on_meta, channels_last=cfg.channels_last)
        # Counted before the per-rank RNG streams start: reading a sample may draw augmentation randomness. A model
        # built on the meta device (fsdp: filled after sharding) is counted there, on a meta copy of the sample.
        on = torch.device("meta") if any(p.is_meta for p in module.parameters()) else ctx.device
        flops = (perf.task_flops_per_sample(module, self.task, train_ds, on, self.data.train.collate_fn)
                 if ctx.is_main else 0.0)
        warn_unsynced_batchnorm(module, cfg.strategy, cfg.batch_size, ctx)
        fill = (cfg.seed, hf.pretrained_dir(data) if hf.is_hf(cfg.model) else None)  # of a model built on meta
        self.parallel = build_parallel(module, ctx, cfg.section("parallel"), cfg.section("performance"), cfg.use_amp,
                                       fill)  # then its strategy's wrapper
        self.watchdog.phase("setup")
        optim = self._build_optimization(parts)
        autocast = make_autocast(cfg.use_amp, cfg.amp_dtype, cfg.strategy, ctx.device)
        # One batch through collate, loss and metrics on every rank: a user's mistake is one line now, not a
        # traceback at the first step or eval. Before the RNG streams below, which reseed what it drew.
        check_first_batch(self, plugin_names(data, parts), autocast, cfg.channels_last)
        # Per-rank RNG streams from here on: data order and augmentation never read them.
        seed_rank_rngs(cfg.seed, ctx.rank)
        self.position = Position(step=0, epoch=0, cursor=0, global_batch_size=layout.global_batch_size,
                                 world_size=ctx.world_size)
        # The user's callbacks (`fit`'s, then --callbacks'), then the built-ins the flags ask for.
        self.callbacks = run_callbacks(cfg.section("eval"), parts.callbacks or (), self.parallel.sharded)
        self.run_view = TrainingRun(self)
        self._build_services(flops, autocast)
        self.stepper = StepRunner(training, cfg.section("performance"), ctx, self.parallel, self.task,
                                self.optimizer, optim.scaler, autocast,
                                StepServices(self.watchdog, self.profiler, self.train_log.clock, self.window,
                                             self.injector, self.sample_log))
        model = ModelState(module, self.optimizer, self.parallel, ctx, lambda: self.checkpoints.group, cfg.optimizer,
                           cfg.model, cfg.lora_rank)
        self.loop_state = LoopState(self.vote, self.run_view)
        data_state = DataState(self.data.stream_position, cfg.num_workers, self.sample_log)
        # What a checkpoint holds, part by part (loop/checkpointed.py): the manager saves them, and restores them in
        # this order.
        self.states = {"model": model, "optim": optim, "log": LogState(self.train_log, self.window),
                       "trainer": self.loop_state, "data": data_state,
                       "callbacks": CallbackState(self.callbacks, self.run_view), "rng": RngState(ctx.device, cfg.seed)}
        # The tokenizer's files (and --chat_template's), not their paths: a checkpoint continues on the ids it learnt.
        digest = hf.tokenizer_digest(Path(cfg.tokenizer), cfg.chat_template) if cfg.tokenizer else None
        self.checkpoints = CheckpointManager(cfg.section("checkpoint"), ctx, self.states, self.position,
                                             cfg.checkpoint_path, cfg.checkpoint_timeout_s, config=cfg.to_dict(),
                                             tokenizer_digest=digest, injector=self.injector,
                                             mapped_reads=self.parallel.sharded, phase=self.watchdog.phase)
        self.final = FinalWeights(data, ctx, run_dir, model, self.checkpoints, self.callbacks.ema)

    def _build_optimization(self, parts: Parts) -> OptimState:
        """Optimizer, schedule and fp16 scaler, from the [training] section. The linear scaling rule is opt-in:
        lr * global batch / base batch."""
        cfg, ctx, module = self.cfg, self.ctx, self.module
        training, global_batch = cfg.section("training"), self.data.layout.global_batch_size
        lr = peak_lr(training, global_batch)
        lr_warning = cfg.lr_scaling_warning(global_batch)  # None unless actionable
        if ctx.is_main and lr_warning:
            log.warning("%s", lr_warning)
        if parts.optimizer is not None:
            self.optimizer = parts.optimizer([p for p in module.parameters() if p.requires_grad])
        else:
            self.optimizer = build_optimizer(training, parameter_groups(training, module), lr,
                                             fused=not self.parallel.sharded)
        self.total_steps = self.data.total_steps(cfg.epochs, cfg.max_steps, say=ctx.is_main)
        own_schedule = parts.scheduler is None  # ddptrain's: the config decides its lr on resume
        scheduler = (build_scheduler(training, self.optimizer, lr, self.total_steps)
                     if own_schedule else parts.scheduler(self.optimizer))
        scaler = torch.amp.GradScaler(ctx.device.type) if cfg.use_amp and cfg.amp_dtype == "fp16" else None
        return OptimState(self.optimizer, scheduler, scaler, lr, own_schedule)

    def _build_services(self, flops_per_sample: float, autocast: Any) -> None:
        """What runs beside the steps: profiler, the control vote, the metric window,
        log and sinks, the evaluator, the sample-id record. (The checkpoints, of the parts: in __init__.)"""
        cfg, ctx, run_dir, device = self.cfg, self.ctx, self.run_dir, self.ctx.device
        self.profiler = StepProfiler(cfg.enable_profiling, run_dir, ctx.rank, cfg.profile_wait,
                                     cfg.profile_warmup, cfg.profile_active)
        self.vote = LaggedVote(ctx, cfg.control_interval)
        self.trackers = (Trackers.of_run(cfg.section("observe"), ctx, run_dir, ddptrain.__version__, cfg.to_dict(),
                                         resume=cfg.auto_resume) if ctx.is_main else None)
        self.sinks = MetricSinks(run_dir, cfg.tensorboard, self.trackers) if ctx.is_main else None
        self.window = MetricWindow(device, cfg.log_interval)
        self.train_log = TrainLog(ctx, self.sinks, Clock(device), self.data.layout.global_batch_size, self.task.unit,
                                  flops_per_sample, cfg.peak_tflops or perf.known_peak_tflops(device),
                                  cfg.straggler_skew, cfg.max_skipped_steps,
                                  on_record=(lambda record: self.callbacks.call("on_log", self.run_view, record))
                                  if self.callbacks and ctx.is_main else None)
        self.evaluator = Evaluator(ctx, self.data.eval, self.task, autocast, cfg.channels_last,
                                   lockstep=self.parallel.sharded)
        self.sample_log = (SampleLog(run_dir, ctx.rank, self.data.stream_position) if cfg.record_sample_ids
                           else None)

    # ------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to the end (epochs or --max_steps), evaluating each epoch and checkpointing as asked.

        Must be called on all ranks. Raises Preempted after a preemption checkpoint has committed, and after a
        complete run whose final save a signal interrupted (its weights written all the same).
        """
        status = "failed"
        # A signal is a flag from the first step to the run's record: it never cuts a save or an export.
        with self.watchdog if self._own_watchdog else contextlib.nullcontext(), self.signals:
            try:
                summary = self._fit()
                status = "finished"
            except Preempted:
                status = "preempted"
                raise
            finally:
                if self.trackers:
                    self.watchdog.phase("teardown")
                    self.trackers.close(status)  # after the weights' export: --tracker_log_model sends them
        if self.final.signalled:
            raise Preempted(self.position.step, self.final.signalled, finished=True)
        return summary

    def _fit(self) -> dict[str, Any]:
        cfg, pos, data, loop_state = self.cfg, self.position, self.data, self.loop_state
        started = time.perf_counter()
        with self.profiler, self._outputs_closed_at_exit():
            finished = self._resume()
            if finished is not None:  # this run's end, recorded: nothing is evaluated, saved or written again
                return self.final.unchanged(finished)
            if loop_state.stopped is not None:
                log.info("run stopped early at step %d (%s) in %s; nothing to train (use another --run_dir, or "
                         "--no-auto_resume to start over)", pos.step, loop_state.stopped["reason"], self.run_dir)
            elif not self._training():
                log.info("run already complete at step %d in %s; its end follows (use another --run_dir, or "
                         "--no-auto_resume to start over)", pos.step, self.run_dir)
            self.callbacks.call("on_train_start", self.run_view)
            # The callbacks' state is that of the snapshot, taken before its checkpoint committed: what they
            # did on hearing of the commit is done again, as in the run that saved it.
            self._announce_checkpoint()
            bar = ProgressBar(cfg.progress and self.ctx.is_main, self.total_steps, initial=pos.step)
            if data.stream is not None:
                # A stream has no epochs in common: each rank cycles its own share until --max_steps.
                with stream_batches(data.train, data.stream, data.stream_position, data.background) as batches:
                    while self._training():
                        self._step(batches, bar)
            # Each pass of this loop is (the rest of) one epoch: the sampler resumes at the cursor. A checkpoint of
            # an epoch's last step resumes into that epoch's end (its eval, the next epoch), training on or not.
            global_batch = data.layout.global_batch_size
            ended = lambda: pos.cursor + global_batch > data.num_train  # noqa: E731
            while data.stream is None and (self._training() or ended()):  # to total_steps, an epoch's end
                data.sampler.set_position(pos.epoch, pos.cursor)
                with epoch_batches(data.train, background=data.background) as batches:
                    while not ended() and self._training():
                        self._step(batches, bar)
                if not ended():
                    break  # --max_steps (or a stop) ended the run mid-epoch
                # The epoch is complete: evaluate, move the cursor to the next epoch, maybe save.
                if loop_state.last_eval.get("step") != pos.step:
                    self.evaluate()
                pos.epoch, pos.cursor = pos.epoch + 1, 0
                self._checkpoint(epoch_end=pos.epoch)

            # The end: log the partial window, evaluate if the last epoch ended early, final save. The last
            # step's gradients are spent: freed first, the final eval, save and gathered export need none.
            self.optimizer.zero_grad(set_to_none=True)
            if self.window.steps:
                self._log_train(bar)
            self.train_log.finish()
            if loop_state.last_eval.get("step") != pos.step:
                self.evaluate()
            self.vote.drain()  # a preemption flag still in flight is moot: the final save follows
            self.watchdog.phase("replica check")
            self.parallel.check_replicas()
            self._checkpoint(now=True)
            self._wait_for_checkpoint()
        bar.close()
        self.watchdog.phase("final save")
        self.injector.at_final(pos.step)
        self.final.write(pos.step, cfg.load_best_at_end)
        summary = self.train_log.summary(pos, loop_state.last_eval, time.perf_counter() - started, self.run_dir,
                                         self.final.about())
        # The last collective: whether a signal came during the end. One from here on acts at once: the run is whole.
        self.final.record_finished(summary, self.signals.agreed(self.ctx), self.total_steps, loop_state.stopped)
        self.signals.release()
        self.callbacks.call("on_train_end", self.run_view, summary)
        return summary

    def _training(self) -> bool:
        """Whether another step follows: not at --max_steps (or the epochs' end), no agreed stop."""
        return self.position.step < self.total_steps and self.loop_state.stopped is None

    def _step(self, batches: Iterator, bar: ProgressBar) -> None:
        """A training step and what follows it at the step boundary: schedule, logging, flags, saves."""
        cfg, pos = self.cfg, self.position
        self.train_step(batches)
        self.train_log.finish()  # the line of the log step before this step: its numbers arrived meanwhile
        pos.step += 1
        pos.cursor += self.data.layout.global_batch_size
        self.states["optim"].step_schedule(first=pos.step == 1 + self._first_step)
        self.profiler.step()
        if pos.step == 1 + self._first_step:
            # Tier two: the generous init timeout covered rendezvous and the first step.
            self.ctx.set_collective_timeout(cfg.collective_timeout_s)
            self.train_log.write_memory(self.stepper.memory_held(), pos.step, pos.epoch, cfg.strategy)
        if pos.step % cfg.log_interval == 0:
            self._log_train(bar)
        self.callbacks.call("on_step_end", self.run_view)  # before the step's eval: it sees the EMA of this step
        if cfg.eval_every_steps and pos.step % cfg.eval_every_steps == 0:
            self.evaluate()
        self._between_steps()

    def train_step(self, batches: Iterator) -> None:
        """One optimizer step over `grad_accum_steps` micro-batches (`StepRunner.run`). All ranks."""
        self.stepper.run(batches, self.position.step + 1)  # the number of this step: steps done once it completes

    def evaluate(self) -> dict[str, Any]:
        """Exact eval of the task's metrics over the eval set (rank 0's buffers). Must be called on all ranks."""
        self.train_log.finish()  # the train line of this step comes before its eval line
        self.watchdog.phase("eval")
        self.injector.at_eval(self.position.step)
        self.parallel.sync_buffers()
        result = self.evaluator.evaluate(self.module, heartbeat=lambda: self.watchdog.phase("eval"))
        ema = self.final.ema
        if result and ema is not None and self.cfg.ema_eval:
            with ema.swapped_in(self.module):
                averaged = self.evaluator.evaluate(self.module, heartbeat=lambda: self.watchdog.phase("eval"))
            result.update({f"ema_{key}": value for key, value in averaged.items() if key != "samples"})
        pos, loop_state = self.position, self.loop_state
        loop_state.evaluated(pos.step, result)  # (no eval set: nothing to evaluate at this step either)
        if not result:
            return {}
        self.train_log.write_eval(result, pos.step, pos.epoch)
        self.callbacks.call("on_eval", self.run_view, result)
        if self.run_view.stop_now:  # a decision on these metrics, the same on every rank: this is the last step
            self.loop_state.agree_to_stop(pos.step, self.run_view.stop_reason)
        return loop_state.last_eval

    # --- between steps: control flags, saves -----------------------------------------------------
    def _between_steps(self) -> None:
        """Act on preemption and timed saves at a step boundary, agreed by one tiny CPU all-gather.

        Signals and clocks differ between ranks; the MAX over ranks makes the decision the same everywhere.
        The vote is cast every --control_interval steps and read one step later (see `LaggedVote`), so
        nothing waits for it and the steps in between carry no collective of ddptrain's.
        """
        step = self.position.step
        self.watchdog.phase("sync")
        main = self.ctx.is_main  # rank 0's clock decides what depends on the time
        due_by_time = main and self.checkpoints.schedule.minutes_up()
        out_of_time = main and self.signals.out_of_time()
        line = self.train_log.unsent()  # a log step's numbers (CPU): gathered with the vote when it is cast here
        (preempt, timed, time_up, stop), rows = self.vote.exchange(  # in the order of checkpointed.VOTE_FLAGS
            step, [self.signals.received is not None, due_by_time, out_of_time, self.run_view.stop_reason is not None],
            line)
        if line is not None:
            self.train_log.send(rows)
        if stop or self.run_view.stop_now:
            self.loop_state.agree_to_stop(step, self.run_view.stop_reason or "a callback on another rank asked to stop")
        if preempt or time_up:
            # The checkpoint holds a stop agreed at this step: the rerun ends here, as the run would have.
            self._checkpoint(now=True)
            self._wait_for_checkpoint()  # raises if it did not commit: no preemption claims a save it lacks
            self.signals.exit(step, preempt, self.run_dir if self.ctx.is_main else None)
        self._checkpoint(timed=bool(timed))

    def _checkpoint(self, **when: Any) -> None:
        """A step boundary, handed to the checkpoint manager with a callback's best request: it saves the run's
        parts if its schedule says so (or `now=True`). All ranks."""
        if self.checkpoints.save(best=self.states["callbacks"].take_best(), **when):
            self._announce_checkpoint()

    def _wait_for_checkpoint(self) -> None:
        """Wait for an async save in flight to commit, under the checkpoint's time limit (not a step's), and
        raise on every rank if it did not. All ranks."""
        self.watchdog.phase("checkpoint")
        self.checkpoints.wait()
        self._announce_checkpoint()

    def _announce_checkpoint(self) -> None:
        """`on_checkpoint` for a checkpoint every rank now knows committed (an async one: at the next wait)."""
        self.states["callbacks"].announce(self.checkpoints.last_saved_step)

    def _resume(self) -> dict[str, Any] | None:
        """Restore the newest usable checkpoint (or --resume_from). Returns the record of this run's end
        (`FinalWeights.finished`) where the checkpoint is the one the run finished on. All ranks."""
        self._first_step = 0
        self.watchdog.phase("load")
        finished = self.final.finished()
        model = self.states["model"]
        loaded = self.checkpoints.load(model.checkpointed(model.module.state_dict()))  # every part, and the position
        # The step the run finished at, the same plan (a stop decided after that step's save is in the record): done.
        if loaded is not None and finished and finished["step"] == self.position.step and (
                not self._training() or finished.get("total_steps") == self.total_steps):
            return finished
        self.final.clear_markers()
        if loaded is not None:
            self._first_step = self.position.step
        self.checkpoints.start_line(loaded)
        best = self.callbacks.best
        if self.ctx.is_main and best is not None and best.watch.best_step >= 0:
            self.checkpoints.owe_best({"step": best.watch.best_step, **best.about()})
        return None

    # --- metrics ---------------------------------------------------------------------------------
    def _log_train(self, bar: ProgressBar) -> None:
        self.watchdog.phase("log")
        if self.sample_log is not None:
            self.sample_log.flush()
        pos = self.position
        self.train_log.write(self.window, pos.step, pos.epoch, self.total_steps, self.optimizer.param_groups[0]["lr"],
                             bar)
        self.window.reset()

    # --- the end ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the loaders' worker processes now (`Loaders.close`). Safe to call twice."""
        self.data.close()

    @contextlib.contextmanager
    def _outputs_closed_at_exit(self) -> Iterator[None]:
        """Metric lines and sample ids already produced reach the disk however `fit` ends."""
        try:
            yield
        finally:
            if self.sample_log is not None:
                self.sample_log.close()
            if self.sinks is not None:
                self.sinks.close()
