"""The end of a run: which weights are final (--load_best_at_end), the files that hold them
(RUN_DIR/model.safetensors, hf/, LoRA's adapter and, under ddp, its merge into the base in hf/, the --ema_decay
average), and the record that the run is complete (RUN_DIR/FINISHED), which a rerun reads to change nothing."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from ddptrain.checkpoints.format import BEST_ABOUT, read_json, safetensors_bytes, write_atomic
from ddptrain.config import DataSettings
from ddptrain.errors import TrainingError
from ddptrain.loop.checkpointed import ModelState, RankStates
from ddptrain.models import hf, lora
from ddptrain.parallel.procenv import FINISHED_MARKER, PREEMPTED_MARKER

log = logging.getLogger("ddptrain")


class FinalWeights:
    """The final weights of a run, their step, and where they are written. All methods: all ranks."""

    def __init__(self, data: DataSettings, ctx: Any, run_dir: Path, model: ModelState, checkpoints: Any, ema: Any):
        self.data, self.ctx, self.run_dir = data, ctx, run_dir  # [data]: the model and tokenizer the files name
        self.model, self.checkpoints, self.ema = model, checkpoints, ema
        self.step = 0  # the step of the weights the final files hold
        self.best: dict[str, Any] | None = None  # --load_best_at_end: the best step's metric, where it loaded one
        self.signalled: str | None = None  # a signal that came during the run's end, which went on to finish
        # Now: a run that fails later leaves it too. (LoRA: hf/ is the merged model, whole at the end or not at all.)
        if hf.is_transformers(model.module) and not model.frozen and ctx.is_main:
            model.module.config.save_pretrained(run_dir / hf.HF_DIR)  # what `ddptrain export --hf` rebuilds it from

    def write(self, last_step: int, load_best: bool) -> None:
        """The final files, of the last step's weights or (`load_best`: --load_best_at_end) best/'s."""
        self.step = last_step
        if load_best:
            self.checkpoints.confirm_best()  # best/ committed before its weights become the final ones
            self.load_best(last_step)
        self.export()
        self.checkpoints.confirm_best()  # after the weights: a best/ that could not be made fails a finished run

    def load_best(self, last_step: int) -> None:
        """best/'s weights into the model (and its average into the EMA), so that the final weights are the best
        step's; where best/ holds the average (an ema_ metric), the model gets that."""
        loaded = self.checkpoints.read_best(self.model.checkpointed(self.model.module.state_dict()))
        if loaded is None:
            if self.ctx.is_main:
                log.warning("--load_best_at_end: no evaluation made a best checkpoint; the final weights are the "
                            "last step's (%d)", last_step)
            return
        self.model.load_weights(loaded)  # the optimizer's too: only weights are written from here
        self.step = loaded.position.step
        about = read_json(loaded.path / BEST_ABOUT) or {}
        self.best = {"metric": about.get("metric"), "value": about.get("value")}
        if self.ema is not None:
            ranks = RankStates(loaded.trainer["rng"], self.ctx.rank, self.ctx.world_size)
            restored = self.ema.restore_now(ranks.own.get("callbacks", {}).get(self.ema.name),
                                            ranks.ranks[0].get("callbacks", {}).get(self.ema.name))
            if not all(self.ctx.all_gather_object(restored)):  # sharded on another world size: not here
                raise TrainingError(f"--load_best_at_end: the average in {loaded.path} was sharded for "
                                    f"{loaded.position.world_size} processes, this run has {self.ctx.world_size}: "
                                    "export it with `ddptrain export --weights ema`")
            if about.get("weights") == "ema":
                self.ema.copy_to(self.model.module)
        if self.ctx.is_main:
            log.info("--load_best_at_end: the final weights are those of %s (step %d, %s %s, %s weights)",
                     loaded.path, loaded.position.step, about.get("metric"), about.get("value"),
                     about.get("weights", "trained"))

    def export(self) -> None:
        """RUN_DIR/model.safetensors, for a transformers model RUN_DIR/hf/ (save_pretrained), with --ema_decay
        RUN_DIR/model_ema.safetensors. Under LoRA: model.safetensors holds what trained, RUN_DIR/adapter/ is
        PEFT's layout, and hf/ the base with the adapters merged (ddp: rank 0 holds the whole base)."""
        parallel, module, frozen = self.model.parallel, self.model.module, self.model.frozen
        step = {"step": str(self.step)}
        ema_meta = {**step, "ema_decay": repr(self.ema.decay if self.ema is not None else 0.0)}
        if parallel.sharded and not frozen:  # (LoRA's adapters: below)
            # Streamed a tensor at a time: no rank gathers the whole model. RUN_DIR/hf/ in HF's sharded layout.
            hf_dir = self.run_dir / hf.HF_DIR if hf.is_transformers(module) else None
            parallel.export(self.run_dir / "model.safetensors", step, hf_dir)
            if hf_dir is not None and self.ctx.is_main:
                hf.save_pretrained_files(self.data, module, hf_dir)
            if self.ema is not None:
                with self.ema.swapped_in(module):
                    parallel.export(self.run_dir / "model_ema.safetensors", ema_meta)
            return
        # Sharded: gathered onto rank 0. LoRA: what trained, and the frozen tensors PEFT's layout holds too (an
        # adapted embedding's base weights).
        saved = lora.saved_names(module) if frozen else {}
        state = parallel.state_dict([name for name in frozen if name not in saved])
        if self.ctx.is_main:
            left_out = set(frozen)
            trained = {name: value for name, value in state.items() if name not in left_out}
            write_atomic(self.run_dir / "model.safetensors", safetensors_bytes(trained, metadata=step))
            if frozen:
                lora.save_adapter(module, state, self.run_dir / lora.ADAPTER_DIR)
                hf.copy_tokenizer(self.data, self.run_dir / lora.ADAPTER_DIR)  # base + adapter + tokenizer: all it takes
                if hf.is_transformers(module):
                    self.write_merged(module, parallel.sharded)
            elif hf.is_transformers(module):
                hf.save_pretrained(self.data, state, self.run_dir / hf.HF_DIR, module)
        if self.ema is not None:
            with self.ema.swapped_in(module):  # a replica's state dict holds the parameters themselves:
                averaged = {k: v.clone() for k, v in parallel.state_dict(frozen).items()}  # copy before the swap back
            if self.ctx.is_main:
                write_atomic(self.run_dir / "model_ema.safetensors", safetensors_bytes(averaged, metadata=ema_meta))

    def write_merged(self, module: Any, sharded: bool) -> None:
        """RUN_DIR/hf/ of a LoRA run: the base with the adapters merged (peft's merge), in the save_pretrained
        layout. Under fsdp/hsdp no rank holds the base whole, and merging would gather it: hf/ is not written,
        and the log says where the trained model is. Rank 0."""
        if sharded:
            log.info("%s/ not written: merging the adapters needs the whole base, which no rank of a sharded run "
                     "holds; the trained model is --model + %s (PeftModel.from_pretrained), or merge it in one "
                     "process with `ddptrain export %s --hf OUT_DIR --merge`", hf.HF_DIR,
                     self.run_dir / lora.ADAPTER_DIR, self.run_dir)
            return
        hf.save_pretrained(self.data, lora.merged(module), self.run_dir / hf.HF_DIR, module)

    def about(self) -> dict[str, Any]:
        """What the final files hold, for the run's summary: their step, and the best step's metric where
        --load_best_at_end loaded it."""
        return {"weights_step": self.step, **({"best": self.best} if self.best else {})}

    # --- the record of the end --------------------------------------------------------------------
    def finished(self) -> dict[str, Any] | None:
        """RUN_DIR/FINISHED as rank 0 reads it (on every rank): the step, time and summary of this run's end, or
        None where it has not ended (or its record cannot be read). All ranks."""
        record = None
        if self.ctx.is_main:
            try:
                record = json.loads((self.run_dir / FINISHED_MARKER).read_text())
            except (OSError, ValueError):
                record = None
            if not (isinstance(record, dict) and isinstance(record.get("step"), int) and "summary" in record):
                record = None  # an earlier version's record holds no summary: the run's end is made again
        return self.ctx.broadcast_object(record)

    def unchanged(self, record: dict[str, Any]) -> dict[str, Any]:
        """A rerun of the run `record` (`finished`) says so and changes nothing: its summary, as the run returned
        it (rank 0 says it)."""
        if self.ctx.is_main:
            stopped, summary = record.get("stopped"), record["summary"]
            log.info("run %s at step %d (%s) in %s; nothing changed (use another --run_dir, or --no-auto_resume to "
                     "start over)", "stopped early" if stopped else "already complete", record["step"],
                     stopped["reason"] if stopped else f"{summary['epoch']} epochs", self.run_dir)
        return record["summary"]

    def clear_markers(self) -> None:
        """The run goes on: its FINISHED and PREEMPTED markers of an earlier end are gone (rank 0)."""
        if self.ctx.is_main:
            for marker in (PREEMPTED_MARKER, FINISHED_MARKER):
                (self.run_dir / marker).unlink(missing_ok=True)

    def record_finished(self, summary: dict[str, Any], signal_name: str | None, total_steps: int,
                        stopped: dict[str, Any] | None) -> None:
        """RUN_DIR/FINISHED: the run is complete and its final files written (rank 0), with its summary, the steps it
        planned and the early stop it made, if any. A signal that came during the end (`signal_name`, kept as
        `signalled` on every rank) is recorded as a preemption of a complete run, which the launcher reports."""
        self.signalled = signal_name
        if not self.ctx.is_main:
            return
        now = time.time()
        if signal_name is not None:
            write_atomic(self.run_dir / PREEMPTED_MARKER, json.dumps(
                {"step": summary["step"], "signal": signal_name, "finished": True, "time": now}).encode())
            log.warning("%s came during the run's end, which finished: the run is complete at step %d, its final "
                        "weights written; exiting as preempted (a rerun finds it complete and changes nothing)",
                        signal_name, summary["step"])
        write_atomic(self.run_dir / FINISHED_MARKER, json.dumps({"step": summary["step"], "time": now,
                                                                 "total_steps": total_steps, "stopped": stopped,
                                                                 "summary": summary}).encode())
