"""The end of a run: which weights are final (--load_best_at_end) and the files that hold them
(RUN_DIR/model.safetensors, hf/ or LoRA's adapter, the --ema_decay average)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ddptrain.checkpoints.format import BEST_ABOUT, read_json, safetensors_bytes, write_atomic
from ddptrain.config import DataSettings
from ddptrain.errors import TrainingError
from ddptrain.loop.checkpointed import ModelState, RankStates
from ddptrain.models import hf, lora

log = logging.getLogger("ddptrain")


class FinalWeights:
    """The final weights of a run, their step, and where they are written. All methods: all ranks."""

    def __init__(self, data: DataSettings, ctx: Any, run_dir: Path, model: ModelState, checkpoints: Any, ema: Any):
        self.data, self.ctx, self.run_dir = data, ctx, run_dir  # [data]: the model and tokenizer the files name
        self.model, self.checkpoints, self.ema = model, checkpoints, ema
        self.step = 0  # the step of the weights the final files hold
        if hf.is_transformers(model.module) and ctx.is_main:  # now: a run that fails later leaves it too
            model.module.config.save_pretrained(run_dir / hf.HF_DIR)  # what `ddptrain export --hf` rebuilds it from

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
        RUN_DIR/model_ema.safetensors."""
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
        state = parallel.state_dict(frozen)  # sharded: gathered onto rank 0 (LoRA: the adapters only)
        if self.ctx.is_main:
            # Under LoRA: the adapters (the rest is the source's).
            write_atomic(self.run_dir / "model.safetensors", safetensors_bytes(state, metadata=step))
            if frozen:
                lora.save_adapter(module, state, self.run_dir / lora.ADAPTER_DIR)
                hf.copy_tokenizer(self.data, self.run_dir / lora.ADAPTER_DIR)  # base + adapter + tokenizer: all it takes
            elif hf.is_transformers(module):
                hf.save_pretrained(self.data, state, self.run_dir / hf.HF_DIR, module)
        if self.ema is not None:
            with self.ema.swapped_in(module):  # a replica's state dict holds the parameters themselves:
                averaged = {k: v.clone() for k, v in parallel.state_dict(frozen).items()}  # copy before the swap back
            if self.ctx.is_main:
                write_atomic(self.run_dir / "model_ema.safetensors", safetensors_bytes(averaged, metadata=ema_meta))
