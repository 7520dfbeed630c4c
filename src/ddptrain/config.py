"""The one TrainConfig: defaults, validation, command-line flags and TOML, all derived from one dataclass.

Precedence: command line > ``--config FILE.toml`` > dataclass defaults. Validation runs once, at the edge
(`resolve_config`), and every failure is a `UsageError` whose one line names the flag and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import importlib
import math
import os
import sys
import tomllib
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, Callable

from ddptrain.cliargs import ArgParser, Switch
from ddptrain.errors import UsageError
from ddptrain.faults import FaultSpec


def opt(default: Any, help: str, *, choices: tuple | None = None, min: float | None = None,
        group: str = "training") -> Any:
    """A config field: its default plus what the flag generator and validator need to know."""
    return field(default=default, metadata={"help": help, "choices": choices, "min": min, "group": group})


@dataclass
class TrainConfig:
    # --- model and data -------------------------------------------------------------------------
    task: str = opt("classification", "what a step computes: classification, regression, language_model, or "
                    "plug-in 'pkg.mod:fn' with fn(cfg) -> an object with loss(model, batch)", group="model and data")
    model: str = opt("mini_resnet", "model: built-in name (mini_resnet, mlp, gpt), plug-in 'pkg.mod:fn' with "
                     "fn(cfg) -> nn.Module, or 'hf:NAME_OR_DIR', a transformers model for the task (a directory "
                     "with weights, or with a config.json alone: fresh weights)", group="model and data")
    dataset: str = opt("synthetic", "dataset: built-in name (synthetic, cifar10, cifar100, imagefolder, "
                       "digits, pydoc, tokens), plug-in 'pkg.mod:fn' with fn(cfg) -> (train_ds, eval_ds | None), "
                       "or 'hf:PATH', records of a JSON lines or Parquet file or a datasets.save_to_disk "
                       "directory, tokenized with --tokenizer", group="model and data")
    data_dir: str = opt("", "directory of a file-based dataset (cifar10, cifar100, imagefolder, tokens)",
                        group="model and data")
    tokenizer: str = opt("", "a Hugging Face tokenizer directory (tokenizer.json, or what save_pretrained "
                         "writes) for --dataset hf:PATH and `ddptrain prepare-text --tokenizer`", group="model and data")
    text_field: str = opt("text", "hf datasets: the field holding the text (language_model without "
                          "--prompt_field; classification)", group="model and data")
    prompt_field: str = opt("", "hf datasets, language_model: the field of the prompt, which is masked from the "
                            "loss (labels -100); with --response_field (unset: the records' prompt and completion "
                            "fields, where they have both and no --text_field)", group="model and data")
    response_field: str = opt("", "hf datasets, language_model: the field of the response the model learns",
                              group="model and data")
    label_field: str = opt("label", "hf datasets, classification: the field of the class index",
                           group="model and data")
    messages_field: str = opt("messages", "hf datasets, language_model: the field of chat records (a list of "
                              "{role, content}), formatted with the tokenizer's chat template; read when the "
                              "records have it and neither --text_field nor prompt and completion",
                              group="model and data")
    train_on: str = opt("assistant", "chat records: the tokens the loss is on (assistant: the assistant's turns "
                        "only; all: every token)", choices=("assistant", "all"), group="model and data")
    chat_template: str = opt("", "chat records: a jinja chat template file to format them with instead of "
                             "--tokenizer's own (e.g. one whose {% generation %} marks say what is learnt)",
                             group="model and data")
    eval_data: str = opt("", "hf datasets: a held-out file or directory in the same format (default: the "
                         "dataset's own validation or test split, if it has one)", group="model and data")
    pad_token_id: int = opt(-1, "the token id padding gets in variable-length batches (-1: the tokenizer's pad "
                            "token, else its end-of-text token, else 0)", min=-1, group="model and data")
    top_k: int = opt(0, "classification: also report top-k accuracy for this k (0 = top-1 only)", min=0,
                     group="model and data")
    seq_len: int = opt(128, "language_model: tokens per training sequence (the model's context)", min=2,
                       group="model and data")
    packing: bool = opt(False, "language_model: place variable-length rows (hf: records, a plug-in's token rows) "
                        "into bins of --seq_len tokens instead of padding each batch, every document kept apart "
                        "(positions restart, no attention across documents): the same loss, without the padding; "
                        "--dataset tokens: each window's documents kept apart",
                        group="model and data")
    vocab_size: int = opt(256, "gpt: vocabulary size (256 = bytes; token files say theirs)", min=2,
                          group="model and data")
    num_layers: int = opt(4, "gpt: transformer blocks", min=1, group="model and data")
    num_heads: int = opt(4, "gpt: attention heads per block (width must divide by it)", min=1,
                         group="model and data")
    num_classes: int = opt(10, "number of classes", min=2, group="model and data")
    in_channels: int = opt(3, "image channels", min=1, group="model and data")
    image_size: int = opt(32, "image height and width in pixels", min=4, group="model and data")
    dataset_size: int = opt(10000, "training samples of the synthetic dataset", min=1, group="model and data")
    eval_size: int = opt(1000, "eval samples of the synthetic dataset (0 = no eval split)", min=0,
                         group="model and data")
    width: int = opt(64, "model width: MiniResNet stages use width, 2*width, 4*width channels; mlp's hidden "
                     "size", min=1, group="model and data")
    norm: str = opt("batch", "MiniResNet normalisation layer", choices=("batch", "group", "none"),
                    group="model and data")
    sync_batchnorm: bool = opt(False, "convert BatchNorm to SyncBatchNorm (CUDA only)", group="model and data")
    num_workers: int = opt(4, "data loader worker processes per rank (0 = load in the training process)",
                           min=0, group="model and data")

    # --- fine-tuning ----------------------------------------------------------------------------
    lora_rank: int = opt(0, "train LoRA adapters of this rank beside the frozen model (peft; 0 = train every "
                         "weight); checkpoints hold the adapters only, RUN_DIR/adapter/ is PEFT's layout", min=0,
                         group="fine-tuning")
    lora_alpha: float = opt(16.0, "LoRA: the update is scaled by lora_alpha / lora_rank", min=0.0,
                            group="fine-tuning")
    lora_dropout: float = opt(0.0, "LoRA: dropout on the adapters' input", min=0.0, group="fine-tuning")
    lora_targets: str = opt("", "LoRA: comma-separated names of the layers to adapt (linear layers, e.g. "
                            "q_proj,v_proj; embeddings, e.g. embed_tokens), or all-linear (peft's: every linear layer "
                            "but the output head); empty = every linear layer inside the model's blocks",
                            group="fine-tuning")
    lora_modules_to_save: str = opt("", "LoRA: comma-separated names of modules trained in full beside the adapters "
                                    "and saved with them (peft's modules_to_save; e.g. embed_tokens,lm_head after "
                                    "adding chat tokens); --strategy ddp", group="fine-tuning")
    lora_rslora: bool = opt(False, "LoRA: rsLoRA, the update scaled by lora_alpha / sqrt(lora_rank) (peft's "
                            "use_rslora)", group="fine-tuning")
    lora_dora: bool = opt(False, "LoRA: DoRA, a trained magnitude per output beside the low-rank direction (peft's "
                          "use_dora); --strategy ddp", group="fine-tuning")
    lora_init: str = opt("true", "LoRA: the adapters' init (peft's init_lora_weights): true (B zero: the model "
                         "starts as the base), gaussian (A normal), orthogonal (--strategy ddp, even rank), false "
                         "(B random too: the adapters change the model from the start)", group="fine-tuning")

    # --- batch and schedule ---------------------------------------------------------------------
    batch_size: int = opt(64, "micro-batch size per process; global batch = batch_size * world size * "
                          "grad_accum_steps", min=1)
    grad_accum_steps: int = opt(1, "micro-batches per optimizer step (gradients reduced on the last only; see "
                                "--fsdp_reduce_every_micro_step)", min=1)
    epochs: int = opt(10, "passes over the training data (unless --max_steps is given)", min=1)
    max_steps: int = opt(0, "train this many optimizer steps, however many epochs that takes (0 = --epochs "
                         "decides)", min=0)
    optimizer: str = opt("sgd", "optimizer", choices=("sgd", "adamw"))
    lr: float = opt(0.01, "peak learning rate", min=0.0)
    momentum: float = opt(0.9, "SGD momentum (AdamW: beta1)", min=0.0)
    weight_decay: float = opt(1e-4, "weight decay", min=0.0)
    decay_all: bool = opt(False, "adamw: also decay biases, norm weights and embeddings (default: not, the "
                          "transformers convention); sgd always decays every parameter")
    lr_schedule: str = opt("constant", "learning-rate schedule after warmup: constant, cosine (to --min_lr), "
                           "linear (to --min_lr)", choices=("constant", "cosine", "linear"))
    warmup_steps: int = opt(0, "linear warmup from 0 to lr over this many optimizer steps", min=0)
    warmup_ratio: float = opt(0.0, "linear warmup over this share of the run's optimizer steps (instead of "
                              "--warmup_steps)", min=0.0)
    min_lr: float = opt(0.0, "final learning rate of the cosine and linear schedules", min=0.0)
    scale_lr: bool = opt(False, "linear scaling rule: lr *= global_batch_size / base_batch_size")
    base_batch_size: int = opt(256, "global batch size that --lr was tuned for (used by --scale_lr)", min=1)
    grad_clip: float = opt(0.0, "clip the global gradient norm to this value (0 = no clipping)", min=0.0)
    use_amp: bool = opt(False, "automatic mixed precision (autocast; bf16 on CPU)")
    amp_dtype: str = opt("bf16", "autocast dtype; fp16 adds a GradScaler and needs CUDA", choices=("bf16", "fp16"))
    max_skipped_steps: int = opt(25, "with --on_nonfinite skip: fail the run after this many updates in a row were "
                                 "skipped (0 = never)", min=0)
    on_nonfinite: str = opt("skip", "when the global gradient norm is NaN/inf: skip the update, or stop",
                            choices=("skip", "stop"))
    seed: int = opt(42, "seed for model init, data order and augmentation", min=0)

    # --- distributed ----------------------------------------------------------------------------
    backend: str = opt("auto", "process-group backend: auto = nccl with CUDA, gloo without",
                       choices=("auto", "nccl", "gloo"), group="distributed")
    nproc: int = opt(0, "local launcher: start this many worker processes through torch's elastic agent "
                     "(0 = run in this process)", min=0, group="distributed")
    max_restarts: int = opt(0, "local launcher: restart all workers this many times after a failure; "
                            "they resume from the newest checkpoint", min=0, group="distributed")
    init_timeout_s: float = opt(900.0, "timeout of rendezvous and collectives until the first step ends",
                                min=1.0, group="distributed")
    collective_timeout_s: float = opt(300.0, "timeout of each collective after the first step", min=1.0,
                                      group="distributed")
    checkpoint_timeout_s: float = opt(900.0, "how long every rank waits for a checkpoint to be written and "
                                      "committed (the watchdog allows the checkpoint phase as long)", min=1.0,
                                      group="distributed")
    hang_timeout_s: float = opt(600.0, "watchdog: a rank with no progress for this long dumps its stacks and "
                                "fails the job (0 = off)", min=0.0, group="distributed")
    strategy: str = opt("ddp", "how the model is spread: ddp = a full replica per rank; fsdp = parameters, "
                        "gradients and optimizer state sharded over all ranks (FSDP2); hsdp = sharded within "
                        "a node, replicated across nodes", choices=("ddp", "fsdp", "hsdp"), group="distributed")
    fsdp_blocks: str = opt("", "fsdp/hsdp: the module classes sharded as one unit each, comma-separated class "
                           "names, or 'pkg.mod:fn' returning the modules (default: the model's fsdp_blocks)",
                           group="distributed")
    fsdp_reduce_every_micro_step: bool = opt(False, "fsdp/hsdp with --grad_accum_steps > 1: reduce-scatter the "
                                             "gradients on every micro-step, so between micro-steps a rank holds "
                                             "only its 1/N shard of them, not the whole model's unsharded fp32 "
                                             "gradients; costs one reduce-scatter per micro-step instead of one "
                                             "per step (hsdp: the cross-node all-reduce too). No effect with "
                                             "--grad_accum_steps 1", group="distributed")
    param_dtype: str = opt("fp32", "fsdp/hsdp: the weights' own dtype: shards, gradients and optimizer state (bf16 "
                           "halves each; the optimizer then updates bf16 weights, so an update below half a weight's "
                           "bf16 spacing is lost). fp32 master weights with bf16 compute: --param_dtype fp32 "
                           "--use_amp", choices=("fp32", "bf16"), group="distributed")
    reduce_dtype: str = opt("fp32", "fsdp/hsdp: the dtype gradients are reduce-scattered (hsdp: and all-reduced) and "
                            "accumulated between micro-steps in; bf16 halves those bytes, fp32 sums exactly-rounded "
                            "once (also under bf16 weights)", choices=("fp32", "bf16"), group="distributed")
    reshard_after_forward: bool = opt(True, "fsdp/hsdp: free each block's gathered parameters after its forward and "
                                      "gather them again in backward (ZeRO-3); --no-reshard_after_forward keeps "
                                      "them from forward to backward (ZeRO-2-like): one all-gather per block per "
                                      "step instead of two, the whole model's parameters held meanwhile. Same "
                                      "result", group="distributed")
    vocab_parallel: bool = opt(True, "fsdp: each rank keeps its rows of the input embedding and output head and "
                               "never gathers them; the activations travel instead (parallel/vocab.py). "
                               "--no-vocab_parallel makes them FSDP units like the blocks. Not under hsdp",
                               group="distributed")
    cpu_offload: bool = opt(False, "fsdp/hsdp: keep parameter shards, gradients and optimizer state in host memory "
                            "(FSDP2 CPUOffloadPolicy): each block is copied to the device for its compute, the "
                            "optimizer steps on the CPU. Same result, slower", group="distributed")
    bucket_cap_mb: float = opt(25.0, "DDP gradient bucket size in MiB", min=0.0, group="distributed")
    static_graph: bool = opt(False, "tell DDP the graph is the same every step (not with --grad_accum_steps > 1)",
                             group="distributed")
    find_unused_parameters: bool = opt(False, "let DDP train a model whose loss leaves some parameters unused in "
                                       "a step (an auxiliary head, a branch taken only sometimes); costs a walk "
                                       "of the autograd graph every step. Without it such a model is refused "
                                       "before the first step, naming the parameters", group="distributed")
    gradient_as_bucket_view: bool = opt(True, "gradients alias DDP's buckets (saves a copy and memory)",
                                        group="distributed")
    control_interval: int = opt(10, "agree on preemption and timed saves every N steps (one tiny CPU "
                                "all-gather; a signal is acted on within N + 1 steps)", min=1, group="distributed")

    # --- run dir and checkpoints ----------------------------------------------------------------
    run_dir: str = opt("", "run directory (default runs/<config file stem>, or runs/default); keep it the "
                       "same across restarts so resume finds it", group="checkpoints")
    checkpoint_dir: str = opt("", "checkpoint directory (default RUN_DIR/checkpoints)", group="checkpoints")
    save_every: int = opt(1, "save a checkpoint every N epochs (0 = not by epoch)", min=0, group="checkpoints")
    save_every_steps: int = opt(0, "save a checkpoint every N optimizer steps (0 = off)", min=0,
                                group="checkpoints")
    save_every_minutes: float = opt(0.0, "save a checkpoint every N minutes of wall time (0 = off)", min=0.0,
                                    group="checkpoints")
    keep_last: int = opt(3, "keep this many committed checkpoints (0 = keep all)", min=0, group="checkpoints")
    resume_from: str = opt("", "checkpoint dir to resume from (default: newest committed one in "
                           "checkpoint_dir, if any)", group="checkpoints")
    accept_config_change: bool = opt(False, "resume even though training settings (model, data, optimizer, "
                                     "lr, seed, ...) differ from the checkpoint's; by default such a resume is "
                                     "refused (exit 2)", group="checkpoints")
    auto_resume: bool = opt(True, "resume from the newest committed checkpoint in checkpoint_dir",
                            group="checkpoints")
    async_checkpoint: bool = opt(False, "write checkpoints in a background thread", group="checkpoints")

    # --- evaluation, stopping, callbacks ---------------------------------------------------------
    eval_every_steps: int = opt(0, "also evaluate every N optimizer steps (0 = at each epoch's end only; a stream: "
                                "at the end only)", min=0, group="evaluation and stopping")
    early_stop_metric: str = opt("", "stop when this eval metric (loss, accuracy, ...) has not improved for "
                                 "--early_stop_patience evaluations (empty = off)", group="evaluation and stopping")
    early_stop_patience: int = opt(3, "early stopping: evaluations without improvement before the stop", min=1,
                                   group="evaluation and stopping")
    early_stop_mode: str = opt("min", "early stopping: whether lower or higher values of the metric are better",
                               choices=("min", "max"), group="evaluation and stopping")
    early_stop_min_delta: float = opt(0.0, "early stopping: the least change that counts as an improvement",
                                      min=0.0, group="evaluation and stopping")
    keep_best: str = opt("", "keep the checkpoint with the best value of this eval metric (loss, accuracy, ...) as "
                         "CHECKPOINT_DIR/best, apart from --keep_last (empty = off)",
                         group="evaluation and stopping")
    keep_best_mode: str = opt("min", "--keep_best: whether lower or higher values of the metric are better",
                              choices=("min", "max"), group="evaluation and stopping")
    load_best_at_end: bool = opt(False, "--keep_best: the final weights (model.safetensors, RUN_DIR/hf, RUN_DIR/adapter, "
                                 "model_ema.safetensors) are the best checkpoint's, not the last step's; the weights "
                                 "best/best.json names (the average for an ema_ metric)",
                                 group="evaluation and stopping")
    ema_decay: float = opt(0.0, "keep an exponential moving average of the parameters with this decay (e.g. 0.999; "
                            "0 = off), saved in checkpoints and exported as RUN_DIR/model_ema.safetensors", min=0.0,
                            group="evaluation and stopping")
    ema_eval: bool = opt(False, "--ema_decay: also evaluate the average at each evaluation (ema_loss, "
                         "ema_accuracy, ... in the eval line)", group="evaluation and stopping")
    max_time: str = opt("", "save and exit with code 75 (rerun to continue) once this much wall time has passed "
                        "since the launch: seconds or [D-]HH:MM:SS, below the scheduler's limit by the time a save "
                        "takes (empty = no limit)", group="evaluation and stopping")
    callbacks: str = opt("", "comma-separated plug-ins 'pkg.mod:fn', each fn() -> a callback object "
                         "(see docs/callbacks.md)", group="evaluation and stopping")

    # --- observability --------------------------------------------------------------------------
    log_interval: int = opt(10, "log train metrics every N optimizer steps", min=1, group="observability")
    enable_profiling: bool = opt(False, "record a torch.profiler window and write a trace per rank to "
                                 "RUN_DIR/traces/", group="observability")
    profile_wait: int = opt(5, "profiler: steps to skip before warming up", min=0, group="observability")
    profile_warmup: int = opt(2, "profiler: warmup steps (recorded, discarded)", min=0, group="observability")
    profile_active: int = opt(3, "profiler: steps recorded into the trace", min=1, group="observability")
    tensorboard: bool = opt(False, "write TensorBoard events to RUN_DIR/tb/ (needs the tensorboard package)",
                            group="observability")
    tracker: str = opt("", "experiment trackers rank 0 sends every metrics line to, comma-separated: mlflow, "
                       "wandb, tensorboard (= --tensorboard); one tracker run per run dir (docs/trackers.md)",
                       group="observability")
    mlflow_tracking_uri: str = opt("", "--tracker mlflow: the tracking server or store (default: "
                                   "MLFLOW_TRACKING_URI, else MLflow's default)", group="observability")
    mlflow_experiment: str = opt("", "--tracker mlflow: the experiment (default: MLFLOW_EXPERIMENT_NAME, else "
                                 "'ddptrain')", group="observability")
    wandb_project: str = opt("", "--tracker wandb: the project (default: WANDB_PROJECT, else 'ddptrain')",
                             group="observability")
    tracker_run_name: str = opt("", "the tracker run's name (default: the run dir's name)", group="observability")
    tracker_log_model: bool = opt(False, "at the end of a finished run, send model.safetensors and config.toml to "
                                  "the trackers as artifacts", group="observability")
    progress: bool = opt(True, "progress bar on rank 0 (only when stderr is a terminal)", group="observability")
    peak_tflops: float = opt(0.0, "per-device peak TFLOP/s for MFU (0 = known GPU table, else no MFU)",
                             min=0.0, group="observability")
    straggler_skew: float = opt(1.5, "name a rank as straggler when its step time exceeds the median by this "
                                "factor at 3 log steps in a row", min=1.0, group="observability")
    record_sample_ids: bool = opt(False, "write the sample ids of every step to RUN_DIR/samples/rank-R.jsonl",
                                  group="observability")
    inject_fault: str = opt("", "fault injection for tests and chaos runs, e.g. 'rank=1,step=5,kind=sigkill' "
                            "(see docs/checkpoints.md; also DDPTRAIN_FAULT)", group="observability")

    # --- performance ----------------------------------------------------------------------------
    activation_checkpointing: bool = opt(False, "recompute each block's activations in backward instead of "
                                         "keeping them (the blocks FSDP shards: --fsdp_blocks, the model's "
                                         "fsdp_blocks, a transformers model's own), under ddp and fsdp",
                                         group="performance")
    channels_last: bool = opt(False, "channels_last memory format for model and inputs", group="performance")
    compile: bool = opt(False, "torch.compile the model (under fsdp/hsdp each block, before it is sharded)",
                        group="performance")

    # ----------------------------------------------------------------------------------------------
    @property
    def checkpoint_path(self) -> Path:
        return Path(self.checkpoint_dir) if self.checkpoint_dir else Path(self.run_dir) / "checkpoints"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def section(self, name: str) -> Any:
        """One section's settings (a [table] of SECTIONS: "checkpoint", "parallel", ...) as a frozen object of
        their own, for a component built from its section alone."""
        if name not in SECTIONS:
            raise KeyError(f"no section {name!r}; the sections are {', '.join(SECTIONS)}")
        return _SECTION_TYPES[name](**{key: getattr(self, key) for key in section_fields(name)})

    def trains_a_transformer(self) -> bool:
        """A language model (--task language_model) or any `hf:` model: trained with `transformer_defaults`."""
        return self.task == "language_model" or self.model.startswith("hf:")

    def transformer_defaults(self) -> dict[str, Any]:
        """What a transformer trains with where its settings leave it, as fine-tuners expect (transformers' and
        TRL's Trainer): AdamW with no weight decay, 3 % of the run warming up then a cosine decay, gradients
        clipped at 1, a peak lr for what trains (LoRA adapters 2e-4, a `hf:` model's whole weights 2e-5, a
        model trained from its init 3e-4), and one loader worker (tokenized rows cost little to read). The
        declared defaults, the image seed's, stay for everything else."""
        lr = 2e-4 if self.lora_rank else 2e-5 if self.model.startswith("hf:") else 3e-4
        return {"optimizer": "adamw", "lr": lr, "weight_decay": 0.0, "lr_schedule": "cosine", "warmup_ratio": 0.03,
                "grad_clip": 1.0, "num_workers": 1}

    def lr_scaling_warning(self, global_batch_size: int) -> str | None:
        """The warning that --lr was tuned for another global batch, or None where it is not actionable.

        Only a run that chose its own --lr or --base_batch_size gets it: the defaults (lr 0.01 for a global
        batch of 256) describe no model's tuning, so an ordinary default run would be warned about nothing
        it decided. Only under SGD, whose rule it is: AdamW (a fine-tune's) does not scale linearly. None as
        well under --scale_lr, or at the base batch.
        """
        defaults = TrainConfig.__dataclass_fields__
        chosen = self.lr != defaults["lr"].default or self.base_batch_size != defaults["base_batch_size"].default
        if self.scale_lr or self.optimizer != "sgd" or global_batch_size == self.base_batch_size or not chosen:
            return None
        factor = global_batch_size / self.base_batch_size
        return (f"global batch {global_batch_size} differs from --base_batch_size {self.base_batch_size}, the batch "
                f"--lr {self.lr:g} was tuned for: the linear scaling rule (--scale_lr) would train at lr "
                f"{self.lr * factor:g} (x{factor:g}); training at {self.lr:g}")

    def settle(self, given: set[str] | None = None) -> None:
        """Fill in what the settings imply: a transformer's training defaults where `given` (the settings a flag,
        a config file or a `fit` argument set; None: those away from their default) leaves them
        (`transformer_defaults`), --tracker tensorboard turns --tensorboard on, and a --resume_from that names
        `checkpoints/step-N` of the run dir (not found from here) is that path."""
        if given is None:
            given = {f.name for f in fields(self) if getattr(self, f.name) != f.default}
        self.given = given  # (not a setting: what set them, for a `fit` that settles this config again)
        if self.trains_a_transformer():
            defaults = self.transformer_defaults()  # (read before any is set: the lr depends on lora_rank only)
            self.by_task = sorted(set(defaults) - given - ({"warmup_ratio"} if self.warmup_steps else set()))
            for name in self.by_task:
                setattr(self, name, defaults[name])
        if "tensorboard" in parse_trackers(self.tracker):
            self.tensorboard = True
        if self.resume_from and not Path(self.resume_from).is_absolute() and not Path(self.resume_from).exists() \
                and (Path(self.run_dir) / self.resume_from).exists():
            self.resume_from = str(Path(self.run_dir) / self.resume_from)

    def validate(self) -> None:
        """Check every field and the combinations; raise UsageError naming the flag and the fix.

        The config alone, changed in nothing: `preflight.check` checks devices, plug-ins, files, packages and
        checkpoints against it.
        """
        for f in fields(self):
            value = getattr(self, f.name)
            meta = f.metadata
            if isinstance(value, float) and not math.isfinite(value):
                raise UsageError(f"--{f.name} must be a finite number (got {value})")
            if meta["choices"] and value not in meta["choices"]:
                raise UsageError(f"--{f.name}: {value!r} is not one of {', '.join(meta['choices'])}")
            if meta["min"] is not None and value < meta["min"]:
                raise UsageError(f"--{f.name} must be >= {meta['min']:g} (got {value})")
        if self.sync_batchnorm and self.backend == "gloo":
            raise UsageError(SYNC_BATCHNORM_ON_CPU)
        if self.strategy != "ddp":
            for flag, value, why in (("amp_dtype fp16", self.use_amp and self.amp_dtype == "fp16",
                                      "use --amp_dtype bf16 (FSDP's policy: bf16 compute, fp32 reduction)"),
                                     ("static_graph", self.static_graph, "it is a DDP setting; drop it"),
                                     ("find_unused_parameters", self.find_unused_parameters,
                                      "it is a DDP setting; drop it"),
                                     ("sync_batchnorm", self.sync_batchnorm, "it is a DDP setting; drop it")):
                if value:
                    raise UsageError(f"--{flag} does not apply to --strategy {self.strategy}: {why}")
        if self.strategy == "ddp":
            for flag, value in (("param_dtype bf16", self.param_dtype != "fp32"),
                                ("reduce_dtype bf16", self.reduce_dtype != "fp32"),
                                ("no-reshard_after_forward", not self.reshard_after_forward),
                                ("cpu_offload", self.cpu_offload)):
                if value:
                    raise UsageError(f"--{flag} applies to --strategy fsdp or hsdp (ddp keeps a whole fp32 replica "
                                     "per rank; --use_amp computes in bf16); drop the flag or pass --strategy fsdp")
        if self.fsdp_reduce_every_micro_step and self.strategy == "ddp":
            raise UsageError("--fsdp_reduce_every_micro_step applies to --strategy fsdp or hsdp (ddp holds whole "
                             "gradients anyway); drop the flag or pass --strategy fsdp")
        if self.static_graph and self.grad_accum_steps > 1:
            # DDP's static graph counts one gradient-ready hook per parameter per iteration; no_sync's
            # extra backward passes break that count (a torch internal assert, reproduced on 2.13).
            raise UsageError("--static_graph cannot be combined with --grad_accum_steps > 1 (DDP's static graph "
                             "does not support no_sync accumulation); drop one of the two flags")
        if self.dataset in FILE_DATASETS and not self.data_dir:
            raise UsageError(f"--dataset {self.dataset} reads files: pass --data_dir DIR")
        if self.enable_profiling and self.profile_active < 1:
            raise UsageError("--profile_active must be >= 1")
        _check_inject_fault(self.inject_fault)
        if self.max_time:
            parse_duration(self.max_time, "--max_time")
        if self.warmup_steps and self.warmup_ratio:
            raise UsageError(f"--warmup_steps {self.warmup_steps} and --warmup_ratio {self.warmup_ratio:g} both say how "
                             "long to warm up; pass one")
        if self.warmup_ratio >= 1.0:
            raise UsageError(f"--warmup_ratio {self.warmup_ratio:g}: must be below 1 (a share of the run's steps)")
        if self.lora_dropout >= 1.0:
            raise UsageError(f"--lora_dropout {self.lora_dropout}: must be below 1 (0 = no dropout)")
        self._validate_lora()
        if self.ema_decay >= 1.0:
            raise UsageError(f"--ema_decay {self.ema_decay}: must be below 1 (0.999 averages over ~1000 steps; 0 is off)")
        if self.packing and self.task != "language_model":
            raise UsageError(f"--packing places token rows for --task language_model, not --task {self.task}; drop "
                             "--packing")
        if self.packing and self.dataset == "pydoc":
            raise UsageError("--packing keeps documents apart; --dataset pydoc is one text with no document ends and "
                             "no padding to save: drop --packing")
        if self.load_best_at_end and not self.keep_best:
            raise UsageError("--load_best_at_end loads the checkpoint --keep_best keeps, which is off; set --keep_best "
                             "(e.g. loss)")
        if self.ema_eval and not self.ema_decay:
            raise UsageError("--ema_eval evaluates the moving average of --ema_decay, which is off; set --ema_decay "
                             "(e.g. 0.999)")
        parse_trackers(self.tracker)  # an unknown tracker's name is a UsageError
        if self.model == "gpt" and self.width % self.num_heads:
            raise UsageError(f"--width {self.width} must be a multiple of --num_heads {self.num_heads} for --model gpt")
        for flag, builtins in (("task", BUILTIN_TASKS), ("model", BUILTIN_MODELS), ("dataset", BUILTIN_DATASETS)):
            name = getattr(self, flag)
            if flag != "task" and name.startswith("hf:"):
                continue  # a name, a file or a directory: checked by preflight and the builders
            if ":" not in name and name not in builtins:
                raise UsageError(f"--{flag} {name!r}: not a built-in ({', '.join(builtins)}) nor a 'pkg.mod:fn' "
                                 "plug-in")

    def _validate_lora(self) -> None:
        """The [finetune] section's LoRA options (what peft offers that ddptrain can save, merge and shard)."""
        given = [flag for flag, on in (("--lora_targets", self.lora_targets), ("--lora_dropout", self.lora_dropout),
                                       ("--lora_modules_to_save", self.lora_modules_to_save),
                                       ("--lora_rslora", self.lora_rslora), ("--lora_dora", self.lora_dora),
                                       ("--lora_init", self.lora_init != "true")) if on]
        if given and not self.lora_rank:
            raise UsageError(f"{'/'.join(given)} configure{'s' if len(given) == 1 else ''} LoRA adapters, which are "
                             "off; set --lora_rank (e.g. 8)")
        targets = [t.strip() for t in self.lora_targets.split(",") if t.strip()]
        if "all-linear" in targets and len(targets) > 1:
            raise UsageError(f"--lora_targets {self.lora_targets}: all-linear stands alone (it names every linear "
                             "layer but the output head); pass it alone or list the layers")
        if self.lora_init.startswith(("pissa", "olora")):
            raise UsageError(f"--lora_init {self.lora_init} rewrites the base weights, which ddptrain reads again "
                             "from --model (to resume, merge, and for PEFT's load of RUN_DIR/adapter onto the base); "
                             f"use one of {', '.join(LORA_INITS)}")
        if self.lora_init not in LORA_INITS:
            raise UsageError(f"--lora_init {self.lora_init}: not one of {', '.join(LORA_INITS)} (peft's eva, corda, "
                             "lora_ga, loftq and mica inits need data or quantization passes ddptrain does not run)")
        if self.lora_init == "orthogonal" and self.lora_rank % 2:
            raise UsageError(f"--lora_init orthogonal needs an even --lora_rank (not {self.lora_rank})")
        if self.strategy != "ddp":
            # Each rank fills its own shards of a base built on the meta device; these compute their tensors
            # from the base's whole weights (DoRA's magnitude, a module's copy) or outside the recorded init.
            for flag, on in (("--lora_dora", self.lora_dora), ("--lora_modules_to_save", self.lora_modules_to_save),
                             ("--lora_init orthogonal", self.lora_init == "orthogonal")):
                if on:
                    raise UsageError(f"{flag} works with --strategy ddp only (under {self.strategy} no rank holds the "
                                     "base's whole weights it is computed from); pass --strategy ddp")


def refuse_ignored(cfg: TrainConfig, given: set[str]) -> None:
    """A flag set on the command line (or as a `fit` argument: `given`) that this config would ignore, where its
    default is on and so `validate` cannot tell it was asked for: a UsageError, as its siblings are. (A config
    file is not asked: RUN_DIR/config.toml holds every setting, and is valid input.)"""
    if "vocab_parallel" in given and cfg.vocab_parallel and cfg.strategy != "fsdp":
        raise UsageError(f"--vocab_parallel splits the embedding and head by rows under --strategy fsdp only (under "
                         f"{cfg.strategy} each rank holds {'whole matrices' if cfg.strategy == 'ddp' else 'FSDP units'}"
                         "); drop the flag or pass --strategy fsdp")
    if "lora_alpha" in given and not cfg.lora_rank:
        raise UsageError("--lora_alpha scales LoRA adapters, which are off; set --lora_rank (e.g. 8)")


BUILTIN_MODELS = ("mini_resnet", "mlp", "gpt")
# --lora_init: peft's init_lora_weights that leave the base as it is and draw from the seeded RNG.
LORA_INITS = ("true", "gaussian", "orthogonal", "false")
# torch's SyncBatchNorm syncs on CUDA, XPU, HPU and PrivateUse1 devices; of these, ddptrain trains on CUDA (nccl).
# Anywhere else its forward would raise at the first step.
SYNC_BATCHNORM_ON_CPU = ("--sync_batchnorm needs a device torch's SyncBatchNorm supports (CUDA, XPU, HPU or a "
                         "PrivateUse1 backend; ddptrain runs it on CUDA with nccl), not CPU/gloo: drop it, or use "
                         "--norm group for statistics that do not depend on the split")


def names_plugin(flag: str, value: str) -> bool:
    """Whether `value` of --task, --model or --dataset (`flag`, without dashes) names a 'pkg.mod:fn' plug-in: it
    has a colon and, for a model or a dataset, is no `hf:` source."""
    return ":" in value and not (flag != "task" and value.startswith("hf:"))


def plugin_refs(cfg: TrainConfig) -> list[tuple[str, str]]:
    """(flag, 'pkg.mod:fn') of every plug-in the config names: callbacks, task, model, dataset."""
    refs = [("--callbacks", ref) for ref in filter(None, (r.strip() for r in cfg.callbacks.split(",")))]
    return refs + [(f"--{flag}", name) for flag in ("task", "model", "dataset")
                   if names_plugin(flag, name := getattr(cfg, flag))]

# What the weights see: a checkpoint trained under other values of these is another training, which a resume
# must not silently continue (--accept_config_change to do it anyway). Not among them: how long to train
# (epochs, max_steps), how the work is spread (processes, strategy, per-process batch and accumulation for
# the same global batch: resumed sample-exactly), and everything about saving, logging and speed.
TRAINING_SETTINGS = (
    "task", "model", "dataset", "data_dir", "tokenizer", "text_field", "prompt_field", "response_field",
    "label_field", "messages_field", "train_on", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets",
    "lora_modules_to_save", "lora_rslora", "lora_dora", "lora_init",
    "pad_token_id", "seq_len", "vocab_size", "num_layers", "num_heads", "num_classes", "in_channels",
    "image_size", "dataset_size", "width", "norm", "sync_batchnorm", "optimizer", "lr", "momentum", "weight_decay",
    "decay_all", "lr_schedule", "warmup_steps", "warmup_ratio", "min_lr", "scale_lr", "base_batch_size", "grad_clip", "use_amp",
    "amp_dtype", "param_dtype", "reduce_dtype", "seed", "packing", "chat_template")
# Settings added after runs named their dir by the digest: counted only away from their default, so that a job
# run again on a newer version finds its run dir (and its checkpoints) where it left them.
_DIGEST_SINCE = {"warmup_ratio": 0.0, "packing": False, "chat_template": "", "lora_modules_to_save": "", "lora_rslora": False,
                 "lora_dora": False, "lora_init": "true"}


def setting_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The training settings whose value in `now` differs from `saved` (a checkpoint's config; both as
    `TrainConfig.to_dict` gives them), as "lr 0.01 -> 0.1"; settings the saved config predates are not compared."""
    return [f"{name} {saved[name]!r} -> {now[name]!r}" for name in TRAINING_SETTINGS
            if name in saved and saved[name] != now[name]]


def settings_digest(cfg: TrainConfig) -> str:
    """8 hex digits of the training settings: the same for every run that trains the same thing."""
    text = "\n".join(f"{name}={getattr(cfg, name)!r}" for name in TRAINING_SETTINGS
                     if name not in _DIGEST_SINCE or getattr(cfg, name) != _DIGEST_SINCE[name])
    return hashlib.sha256(text.encode()).hexdigest()[:8]


FILE_DATASETS = ("cifar10", "cifar100", "imagefolder", "tokens")
BUILTIN_DATASETS = ("synthetic", "digits", "pydoc") + FILE_DATASETS
BUILTIN_TASKS = ("classification", "regression", "language_model")
TEXT_DATASETS = ("pydoc", "tokens")  # token windows for language models (text.py)


def _check_inject_fault(spec: str) -> None:
    if spec:
        FaultSpec.parse(spec, source="--inject_fault")


TRACKERS = ("mlflow", "wandb", "tensorboard")


def parse_trackers(value: str) -> list[str]:
    """`--tracker mlflow,tensorboard` -> ["mlflow", "tensorboard"]; an unknown name is a UsageError."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    for name in names:
        if name not in TRACKERS:
            raise UsageError(f"--tracker {name!r}: not a tracker ddptrain writes to; use {', '.join(TRACKERS)} "
                             "(comma-separated)")
    return names


def parse_duration(text: str, flag: str) -> float:
    """Seconds from "5400", "90:00", "1:30:00" or "2-00:00:00" (SLURM's --time forms with seconds)."""
    try:
        days, dash, clock = text.strip().rpartition("-")
        parts = [float(p) for p in clock.split(":")]
        if len(parts) > 3 or any(p < 0 for p in parts) or (dash and (not days or len(parts) != 3)):
            raise ValueError
        seconds = sum(p * 60 ** i for i, p in enumerate(reversed(parts))) + 86400 * float(days or 0)
    except ValueError:
        raise UsageError(f"{flag} {text!r}: give seconds (5400) or [D-]HH:MM:SS (1:30:00)") from None
    if not seconds > 0 or not math.isfinite(seconds):
        raise UsageError(f"{flag} {text!r}: must be more than 0 seconds")
    return seconds


def load_plugin(ref: str, flag: str) -> Callable:
    """Import 'pkg.mod:fn' and return fn; any failure is a UsageError naming the flag."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise UsageError(f"{flag} {ref!r}: write a plug-in as 'package.module:function'")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # `python -m` adds the cwd; the console script does not
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an import error of any kind inside the user's module
        raise UsageError(f"{flag} {ref!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc}); "
                         "check the module is on PYTHONPATH") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UsageError(f"{flag} {ref!r}: module {module_name!r} has no callable {attr!r}")
    return fn


# --- TOML ----------------------------------------------------------------------------------------

_FIELD_TYPES = {f.name: f.type for f in fields(TrainConfig)}
_PY_TYPES = {"int": int, "float": float, "str": str, "bool": bool}

# The sections of the settings: a config file's [table] -> the group of flags it holds (`--help`'s groups). A key
# may stand at the top level (as every file written before sections did) or in its section's table.
SECTIONS = {"data": "model and data", "finetune": "fine-tuning", "training": "training",
            "parallel": "distributed", "checkpoint": "checkpoints", "eval": "evaluation and stopping",
            "observe": "observability", "performance": "performance"}
_SECTION_OF = {f.name: next(t for t, g in SECTIONS.items() if g == f.metadata["group"]) for f in fields(TrainConfig)}


def section_fields(section: str) -> list[str]:
    """The config keys of one section (a table name of SECTIONS), in declaration order."""
    return [name for name, owner in _SECTION_OF.items() if owner == section]


_SECTION_TYPES = {name: make_dataclass(f"{name.title()}Settings", [(key, Any) for key in section_fields(name)],
                                       frozen=True) for name in SECTIONS}
# The sections a component is built from, by name (a TrainConfig has every attribute of each, too).
(DataSettings, FinetuneSettings, TrainingSettings, ParallelSettings, CheckpointSettings, EvalSettings, ObserveSettings,
 PerformanceSettings) = (_SECTION_TYPES[name] for name in SECTIONS)


def _coerce(name: str, value: Any, source: str) -> Any:
    want = _PY_TYPES[_FIELD_TYPES[name]]
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise UsageError(f"{source}: {name} = {value!r} should be {want.__name__}")
    return value


def load_toml(path: str) -> dict[str, Any]:
    """Read a config file; unknown keys and malformed TOML are UsageErrors naming the file and key."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--config {path}: no such file; pass the path of a TOML config (see configs/)")
    try:
        with p.open("rb") as fh:
            raw = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--config {path}: malformed TOML ({exc})") from None
    out: dict[str, Any] = {}
    for key, value in _flattened(raw, path):
        if key not in _FIELD_TYPES:
            hint = difflib.get_close_matches(key, _FIELD_TYPES, n=1)
            fix = f"did you mean {hint[0]!r}?" if hint else "see `ddptrain train --help` for the keys"
            raise UsageError(f"--config {path}: unknown key {key!r}; {fix}")
        if key in out:
            raise UsageError(f"--config {path}: {key} is set twice (at the top level and in [{_SECTION_OF[key]}]); "
                             "keep one")
        out[key] = _coerce(key, value, f"--config {path}")
    return out


def _flattened(raw: dict[str, Any], path: str) -> list[tuple[str, Any]]:
    """A config file's keys, its [section] tables opened: each key of a table must belong to that section."""
    flat = []
    for key, value in raw.items():
        if not isinstance(value, dict):
            flat.append((key, value))
            continue
        if key not in SECTIONS:
            raise UsageError(f"--config {path}: unknown table [{key}]; the sections are "
                             f"{', '.join(f'[{name}]' for name in SECTIONS)} (or keys at the top level)")
        for inner, inner_value in value.items():
            if inner in _SECTION_OF and _SECTION_OF[inner] != key:
                raise UsageError(f"--config {path}: {inner} belongs in [{_SECTION_OF[inner]}], not [{key}] (or at "
                                 "the top level)")
            if isinstance(inner_value, dict):
                raise UsageError(f"--config {path}: [{key}.{inner}]: sections hold keys, not tables")
            flat.append((inner, inner_value))
    return flat


def toml_value(value: bool | int | float | str) -> str:
    """A config value as it is written in a TOML config file (and read back by `load_toml` unchanged)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def to_toml(cfg: TrainConfig) -> str:
    """The resolved config as TOML that `--config` reads back unchanged."""
    lines = ["# Resolved ddptrain config (defaults < --config file < command line)."]
    lines += [f"{f.name} = {toml_value(getattr(cfg, f.name))}" for f in fields(cfg)]
    return "\n".join(lines) + "\n"


# --- command line --------------------------------------------------------------------------------

def _typed(name: str, kind: type) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--{name} expects {kind.__name__}, got {text!r}") from None

    convert.__name__ = kind.__name__
    return convert


def build_parser(prog: str = "ddptrain train") -> argparse.ArgumentParser:
    """One flag per TrainConfig field (bool -> --x/--no-x), plus --config."""
    parser = ArgParser(prog=prog, allow_abbrev=False, argument_default=argparse.SUPPRESS,
                       description="Train on 1..N processes. Flags override --config, which overrides defaults.")
    parser.add_argument("--config", metavar="FILE.toml", help="TOML file of config keys (flag names)")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in fields(TrainConfig):
        meta = f.metadata
        grp = groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        help_text = f"{meta['help']} (default: {f.default!r})".replace("%", "%%")  # argparse formats it
        kind = _PY_TYPES[f.type]
        if kind is bool:
            grp.add_argument(f"--{f.name}", action=Switch, help=help_text)
        else:
            grp.add_argument(f"--{f.name}", type=_typed(f.name, kind), metavar=kind.__name__.upper(),
                             help=help_text)
    return parser


def resolve_config(argv: list[str], *, validate: bool = True, prog: str = "ddptrain train") -> TrainConfig:
    """Defaults < TOML file < flags, then validation. The only way a TrainConfig is made from user input."""
    args = vars(build_parser(prog).parse_args(argv))
    config_file = args.pop("config", None)
    values = load_toml(config_file) if config_file else {}
    values.update(args)
    cfg = TrainConfig(**values)
    given = set(values)
    if not cfg.run_dir:
        # Runs without a config file get a dir of their own per set of training settings: the same command run
        # again (a restart, a requeue) finds its checkpoints, another command does not train on top of them.
        name = Path(config_file).stem if config_file else f"default-{settings_digest(cfg)}"
        cfg.run_dir = str(Path("runs") / name)
    if validate:
        cfg.settle(given)
        cfg.validate()
        refuse_ignored(cfg, set(args))
    return cfg
