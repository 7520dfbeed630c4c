"""The settings of each component: one typed dataclass per section, with its own rules.

A section is what one component is built from (`TrainConfig.section(name)`): `DataSettings` the task, model and
data, `ParallelSettings` the process group and the strategy, and so on. Its fields carry real types (`Literal`
for a choice) and the help `--help` and docs/configuration.md print; its `validate` holds the rules of its own
fields. Rules that join two sections live in `TrainConfig.validate` (config.py). Every field's name is its flag
(`--seq_len`), its key in a config file (at the top level or in the section's `[table]`) and its `fit` argument.

Torch-free, as everything the command line imports before training.
"""

from __future__ import annotations

import functools
import math
import typing
from dataclasses import Field, dataclass, field, fields
from typing import Any, ClassVar, Literal

from ddptrain.errors import UsageError
from ddptrain.faults import FaultSpec


def opt(default: Any, help: str, *, min: float | None = None) -> Any:
    """A setting: its default, the help text (`--help`, docs/configuration.md) and its least value, if any."""
    return field(default=default, metadata={"help": help, "min": min})


class Section:
    """A component's settings. A subclass is a frozen dataclass of `opt` fields (a component reads its section; it
    does not set the run's settings), `TABLE` (its `[table]` in a config file) and `TITLE` (its group in
    `--help`); it adds its own combinations to `validate`."""

    TABLE: ClassVar[str]
    TITLE: ClassVar[str]

    def validate(self) -> None:
        """Each field's own limits: a finite number, one of a `Literal`'s values, at least its `min`."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise UsageError(f"--{f.name} must be a finite number (got {value})")
            allowed = choices(type(self), f.name)
            if allowed and value not in allowed:
                raise UsageError(f"--{f.name}: {value!r} is not one of {', '.join(allowed)}")
            if f.metadata["min"] is not None and value < f.metadata["min"]:
                raise UsageError(f"--{f.name} must be >= {f.metadata['min']:g} (got {value})")


@functools.cache
def _hints(section: type[Section]) -> dict[str, Any]:
    return typing.get_type_hints(section)


def choices(section: type[Section], name: str) -> tuple[str, ...] | None:
    """The values a `Literal` field may take, or None for a free one."""
    hint = _hints(section)[name]
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else None


def value_type(section: type[Section], name: str) -> type:
    """The Python type of a field's values: bool, int, float or str (a `Literal`'s values are str)."""
    hint = _hints(section)[name]
    return str if typing.get_origin(hint) is Literal else hint


@dataclass(frozen=True)
class DataSettings(Section):
    """What is trained on what: the task, the model and its size, the dataset and how its rows become batches."""

    TABLE: ClassVar[str] = "data"
    TITLE: ClassVar[str] = "model and data"

    task: str = opt("classification", "what a step computes: classification, regression, language_model, or "
                    "plug-in 'pkg.mod:fn' with fn(cfg) -> an object with loss(model, batch)")
    model: str = opt("mini_resnet", "model: built-in name (mini_resnet, mlp, gpt), plug-in 'pkg.mod:fn' with "
                     "fn(cfg) -> nn.Module, or 'hf:NAME_OR_DIR', a transformers model for the task (a directory "
                     "with weights, or with a config.json alone: fresh weights)")
    dataset: str = opt("synthetic", "dataset: built-in name (synthetic, cifar10, cifar100, imagefolder, "
                       "digits, pydoc, tokens), plug-in 'pkg.mod:fn' with fn(cfg) -> (train_ds, eval_ds | None), "
                       "or 'hf:PATH', records of a JSON lines or Parquet file or a datasets.save_to_disk "
                       "directory, tokenized with --tokenizer")
    data_dir: str = opt("", "directory of a file-based dataset (cifar10, cifar100, imagefolder, tokens)")
    tokenizer: str = opt("", "a Hugging Face tokenizer directory (tokenizer.json, or what save_pretrained "
                         "writes) for --dataset hf:PATH and `ddptrain prepare-text --tokenizer`")
    text_field: str = opt("text", "hf datasets: the field holding the text (language_model without "
                          "--prompt_field; classification)")
    prompt_field: str = opt("", "hf datasets, language_model: the field of the prompt, which is masked from the "
                            "loss (labels -100); with --response_field (unset: the records' prompt and completion "
                            "fields, where they have both and no --text_field)")
    response_field: str = opt("", "hf datasets, language_model: the field of the response the model learns")
    label_field: str = opt("label", "hf datasets, classification: the field of the class index")
    messages_field: str = opt("messages", "hf datasets, language_model: the field of chat records (a list of "
                              "{role, content}), formatted with the tokenizer's chat template; read when the "
                              "records have it and neither --text_field nor prompt and completion")
    train_on: Literal["assistant", "all"] = opt("assistant", "chat records: the tokens the loss is on (assistant: the assistant's turns "
                        "only; all: every token)")
    chat_template: str = opt("", "chat records: a jinja chat template file to format them with instead of "
                             "--tokenizer's own (e.g. one whose {% generation %} marks say what is learnt)")
    eval_data: str = opt("", "hf datasets: a held-out file or directory in the same format (default: the "
                         "dataset's own validation or test split, if it has one)")
    pad_token_id: int = opt(-1, "the token id padding gets in variable-length batches (-1: the tokenizer's pad "
                            "token, else its end-of-text token, else 0)", min=-1)
    top_k: int = opt(0, "classification: also report top-k accuracy for this k (0 = top-1 only)", min=0)
    seq_len: int = opt(128, "language_model: tokens per training sequence (the model's context)", min=2)
    packing: bool = opt(False, "language_model: place variable-length rows (hf: records, a plug-in's token rows) "
                        "into bins of --seq_len tokens instead of padding each batch, every document kept apart "
                        "(positions restart, no attention across documents): the same loss, without the padding; "
                        "--dataset tokens: each window's documents kept apart")
    vocab_size: int = opt(256, "gpt: vocabulary size (256 = bytes; token files say theirs)", min=2)
    num_layers: int = opt(4, "gpt: transformer blocks", min=1)
    num_heads: int = opt(4, "gpt: attention heads per block (width must divide by it)", min=1)
    num_classes: int = opt(10, "number of classes", min=2)
    in_channels: int = opt(3, "image channels", min=1)
    image_size: int = opt(32, "image height and width in pixels", min=4)
    dataset_size: int = opt(10000, "training samples of the synthetic dataset", min=1)
    eval_size: int = opt(1000, "eval samples of the synthetic dataset (0 = no eval split)", min=0)
    width: int = opt(64, "model width: MiniResNet stages use width, 2*width, 4*width channels; mlp's hidden "
                     "size", min=1)
    norm: Literal["batch", "group", "none"] = opt("batch", "MiniResNet normalisation layer")
    sync_batchnorm: bool = opt(False, "convert BatchNorm to SyncBatchNorm (CUDA only)")
    num_workers: int = opt(4, "data loader worker processes per rank (0 = load in the training process)",
                           min=0)

    def validate(self) -> None:
        super().validate()
        if self.dataset in FILE_DATASETS and not self.data_dir:
            raise UsageError(f"--dataset {self.dataset} reads files: pass --data_dir DIR")
        if self.packing and self.task != "language_model":
            raise UsageError(f"--packing places token rows for --task language_model, not --task {self.task}; drop "
                             "--packing")
        if self.packing and self.dataset == "pydoc":
            raise UsageError("--packing keeps documents apart; --dataset pydoc is one text with no document ends and "
                             "no padding to save: drop --packing")
        if self.model == "gpt" and self.width % self.num_heads:
            raise UsageError(f"--width {self.width} must be a multiple of --num_heads {self.num_heads} for --model gpt")
        for flag, builtins in (("task", BUILTIN_TASKS), ("model", BUILTIN_MODELS), ("dataset", BUILTIN_DATASETS)):
            name = getattr(self, flag)
            if flag != "task" and name.startswith("hf:"):
                continue  # a name, a file or a directory: checked by preflight and the builders
            if ":" not in name and name not in builtins:
                raise UsageError(f"--{flag} {name!r}: not a built-in ({', '.join(builtins)}) nor a 'pkg.mod:fn' "
                                 "plug-in")


@dataclass(frozen=True)
class FinetuneSettings(Section):
    """LoRA adapters trained beside a frozen model (peft)."""

    TABLE: ClassVar[str] = "finetune"
    TITLE: ClassVar[str] = "fine-tuning"

    lora_rank: int = opt(0, "train LoRA adapters of this rank beside the frozen model (peft; 0 = train every "
                         "weight); checkpoints hold the adapters only, RUN_DIR/adapter/ is PEFT's layout", min=0)
    lora_alpha: float = opt(16.0, "LoRA: the update is scaled by lora_alpha / lora_rank", min=0.0)
    lora_dropout: float = opt(0.0, "LoRA: dropout on the adapters' input", min=0.0)
    lora_targets: str = opt("", "LoRA: comma-separated names of the layers to adapt (linear layers, e.g. "
                            "q_proj,v_proj; embeddings, e.g. embed_tokens), or all-linear (peft's: every linear layer "
                            "but the output head); empty = every linear layer inside the model's blocks")
    lora_modules_to_save: str = opt("", "LoRA: comma-separated names of modules trained in full beside the adapters "
                                    "and saved with them (peft's modules_to_save; e.g. embed_tokens,lm_head after "
                                    "adding chat tokens); --strategy ddp")
    lora_rslora: bool = opt(False, "LoRA: rsLoRA, the update scaled by lora_alpha / sqrt(lora_rank) (peft's "
                            "use_rslora)")
    lora_dora: bool = opt(False, "LoRA: DoRA, a trained magnitude per output beside the low-rank direction (peft's "
                          "use_dora); --strategy ddp")
    lora_init: str = opt("true", "LoRA: the adapters' init (peft's init_lora_weights): true (B zero: the model "
                         "starts as the base), gaussian (A normal), orthogonal (--strategy ddp, even rank), false "
                         "(B random too: the adapters change the model from the start)")

    def validate(self) -> None:
        """What peft offers that ddptrain can save, merge and shard (`TrainConfig.validate`: under which strategy)."""
        super().validate()
        if self.lora_dropout >= 1.0:
            raise UsageError(f"--lora_dropout {self.lora_dropout}: must be below 1 (0 = no dropout)")
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

    def needs_whole_base(self) -> list[str]:
        """The flags given whose tensors are computed from the base's whole weights (DoRA's magnitude, a module's
        copy) or outside the recorded init: what a sharded strategy, each rank filling its own shards of a base
        built on the meta device, cannot do."""
        return [flag for flag, on in (("--lora_dora", self.lora_dora),
                                      ("--lora_modules_to_save", self.lora_modules_to_save),
                                      ("--lora_init orthogonal", self.lora_init == "orthogonal")) if on]


@dataclass(frozen=True)
class TrainingSettings(Section):
    """The batch, the optimizer and its schedule, precision and the numerics of a step."""

    TABLE: ClassVar[str] = "training"
    TITLE: ClassVar[str] = "training"

    batch_size: int = opt(64, "micro-batch size per process; global batch = batch_size * world size * "
                          "grad_accum_steps", min=1)
    grad_accum_steps: int = opt(1, "micro-batches per optimizer step (gradients reduced on the last only; see "
                                "--fsdp_reduce_every_micro_step)", min=1)
    epochs: int = opt(10, "passes over the training data (unless --max_steps is given)", min=1)
    max_steps: int = opt(0, "train this many optimizer steps, however many epochs that takes (0 = --epochs "
                         "decides)", min=0)
    optimizer: Literal["sgd", "adamw"] = opt("sgd", "optimizer")
    lr: float = opt(0.01, "peak learning rate", min=0.0)
    momentum: float = opt(0.9, "SGD momentum (AdamW: beta1)", min=0.0)
    weight_decay: float = opt(1e-4, "weight decay", min=0.0)
    decay_all: bool = opt(False, "adamw: also decay biases, norm weights and embeddings (default: not, the "
                          "transformers convention); sgd always decays every parameter")
    lr_schedule: Literal["constant", "cosine", "linear"] = opt("constant", "learning-rate schedule after warmup: constant, cosine (to --min_lr), "
                           "linear (to --min_lr)")
    warmup_steps: int = opt(0, "linear warmup from 0 to lr over this many optimizer steps", min=0)
    warmup_ratio: float = opt(0.0, "linear warmup over this share of the run's optimizer steps (instead of "
                              "--warmup_steps)", min=0.0)
    min_lr: float = opt(0.0, "final learning rate of the cosine and linear schedules", min=0.0)
    scale_lr: bool = opt(False, "linear scaling rule: lr *= global_batch_size / base_batch_size")
    base_batch_size: int = opt(256, "global batch size that --lr was tuned for (used by --scale_lr)", min=1)
    grad_clip: float = opt(0.0, "clip the global gradient norm to this value (0 = no clipping)", min=0.0)
    use_amp: bool = opt(False, "automatic mixed precision (autocast; bf16 on CPU)")
    amp_dtype: Literal["bf16", "fp16"] = opt("bf16", "autocast dtype; fp16 adds a GradScaler and needs CUDA")
    max_skipped_steps: int = opt(25, "with --on_nonfinite skip: fail the run after this many updates in a row were "
                                 "skipped (0 = never)", min=0)
    on_nonfinite: Literal["skip", "stop"] = opt("skip", "when the global gradient norm is NaN/inf: skip the update, or stop")
    seed: int = opt(42, "seed for model init, data order and augmentation", min=0)

    def validate(self) -> None:
        super().validate()
        if self.warmup_steps and self.warmup_ratio:
            raise UsageError(f"--warmup_steps {self.warmup_steps} and --warmup_ratio {self.warmup_ratio:g} both say how "
                             "long to warm up; pass one")
        if self.warmup_ratio >= 1.0:
            raise UsageError(f"--warmup_ratio {self.warmup_ratio:g}: must be below 1 (a share of the run's steps)")


@dataclass(frozen=True)
class ParallelSettings(Section):
    """The process group, the launcher and how the model is spread over the ranks."""

    TABLE: ClassVar[str] = "parallel"
    TITLE: ClassVar[str] = "distributed"

    backend: Literal["auto", "nccl", "gloo"] = opt("auto", "process-group backend: auto = nccl with CUDA, gloo without")
    nproc: int = opt(0, "local launcher: start this many worker processes through torch's elastic agent "
                     "(0 = run in this process)", min=0)
    max_restarts: int = opt(0, "local launcher: restart all workers this many times after a failure; "
                            "they resume from the newest checkpoint", min=0)
    init_timeout_s: float = opt(900.0, "timeout of rendezvous and collectives until the first step ends",
                                min=1.0)
    collective_timeout_s: float = opt(300.0, "timeout of each collective after the first step", min=1.0)
    checkpoint_timeout_s: float = opt(900.0, "how long every rank waits for a checkpoint to be written and "
                                      "committed (the watchdog allows the checkpoint phase as long)", min=1.0)
    hang_timeout_s: float = opt(600.0, "watchdog: a rank with no progress for this long dumps its stacks and "
                                "fails the job (0 = off)", min=0.0)
    strategy: Literal["ddp", "fsdp", "hsdp"] = opt("ddp", "how the model is spread: ddp = a full replica per rank; fsdp = parameters, "
                        "gradients and optimizer state sharded over all ranks (FSDP2); hsdp = sharded within "
                        "a node, replicated across nodes")
    tp: int = opt(1, "tensor parallel: split each block's layers over this many ranks of a node (a mesh of "
                  "data-parallel x tensor-parallel ranks; the ranks of one group read the same micro-batch), then "
                  "--strategy replicates (ddp) or shards (fsdp; hsdp: within a node, replicated across nodes) that "
                  "over the data-parallel ranks. For the built-in gpt and transformers models with a "
                  "base_model_tp_plan so far", min=1)
    fsdp_blocks: str = opt("", "fsdp/hsdp: the module classes sharded as one unit each, comma-separated class "
                           "names, or 'pkg.mod:fn' returning the modules (default: the model's fsdp_blocks)")
    fsdp_reduce_every_micro_step: bool = opt(False, "fsdp/hsdp with --grad_accum_steps > 1: reduce-scatter the "
                                             "gradients on every micro-step, so between micro-steps a rank holds "
                                             "only its 1/N shard of them, not the whole model's unsharded fp32 "
                                             "gradients; costs one reduce-scatter per micro-step instead of one "
                                             "per step (hsdp: the cross-node all-reduce too). No effect with "
                                             "--grad_accum_steps 1")
    param_dtype: Literal["fp32", "bf16"] = opt("fp32", "fsdp/hsdp: the weights' own dtype: shards, gradients and optimizer state (bf16 "
                           "halves each; the optimizer then updates bf16 weights, so an update below half a weight's "
                           "bf16 spacing is lost). fp32 master weights with bf16 compute: --param_dtype fp32 "
                           "--use_amp")
    reduce_dtype: Literal["fp32", "bf16"] = opt("fp32", "fsdp/hsdp: the dtype gradients are reduce-scattered (hsdp: and all-reduced) and "
                            "accumulated between micro-steps in; bf16 halves those bytes, fp32 sums exactly-rounded "
                            "once (also under bf16 weights)")
    reshard_after_forward: bool = opt(True, "fsdp/hsdp: free each block's gathered parameters after its forward and "
                                      "gather them again in backward (ZeRO-3); --no-reshard_after_forward keeps "
                                      "them from forward to backward (ZeRO-2-like): one all-gather per block per "
                                      "step instead of two, the whole model's parameters held meanwhile. Same "
                                      "result")
    vocab_parallel: bool = opt(True, "fsdp: each rank keeps its rows of the input embedding and output head and "
                               "never gathers them; the activations travel instead (parallel/vocab.py). "
                               "--no-vocab_parallel makes them FSDP units like the blocks. Under --tp the rows "
                               "split over every rank of the (dp, tp) mesh. Not under hsdp")
    cpu_offload: bool = opt(False, "fsdp/hsdp: keep parameter shards, gradients and optimizer state in host memory "
                            "(FSDP2 CPUOffloadPolicy): each block is copied to the device for its compute, the "
                            "optimizer steps on the CPU. Same result, slower")
    bucket_cap_mb: float = opt(25.0, "DDP gradient bucket size in MiB", min=0.0)
    static_graph: bool = opt(False, "tell DDP the graph is the same every step (not with --grad_accum_steps > 1)")
    find_unused_parameters: bool = opt(False, "let DDP train a model whose loss leaves some parameters unused in "
                                       "a step (an auxiliary head, a branch taken only sometimes); costs a walk "
                                       "of the autograd graph every step. Without it such a model is refused "
                                       "before the first step, naming the parameters")
    gradient_as_bucket_view: bool = opt(True, "gradients alias DDP's buckets (saves a copy and memory)")
    control_interval: int = opt(10, "agree on preemption and timed saves every N steps (one tiny CPU "
                                "all-gather; a signal is acted on within N + 1 steps)", min=1)

    def validate(self) -> None:
        super().validate()
        if self.tp > 1 and self.nproc and self.nproc % self.tp:
            raise UsageError(f"--tp {self.tp} must divide --nproc {self.nproc} (each data-parallel rank is a group of "
                             f"{self.tp} processes): pass --nproc {self.nproc // self.tp * self.tp or self.tp}")
        if self.strategy != "ddp":
            for flag in ("static_graph", "find_unused_parameters"):
                if getattr(self, flag):
                    raise UsageError(f"--{flag} does not apply to --strategy {self.strategy}: it is a DDP setting; "
                                     "drop it")
        if self.strategy == "ddp":
            for flag, value in (("param_dtype bf16", self.param_dtype != "fp32"),
                                ("reduce_dtype bf16", self.reduce_dtype != "fp32"),
                                ("no-reshard_after_forward", not self.reshard_after_forward),
                                ("cpu_offload", self.cpu_offload)):
                if value:
                    raise UsageError(f"--{flag} applies to --strategy fsdp or hsdp (ddp keeps a whole fp32 replica "
                                     "per rank; --use_amp computes in bf16); drop the flag or pass --strategy fsdp")
            if self.fsdp_reduce_every_micro_step:
                raise UsageError("--fsdp_reduce_every_micro_step applies to --strategy fsdp or hsdp (ddp holds whole "
                                 "gradients anyway); drop the flag or pass --strategy fsdp")


@dataclass(frozen=True)
class CheckpointSettings(Section):
    """The run dir, when checkpoints are written, how many are kept, and resume."""

    TABLE: ClassVar[str] = "checkpoint"
    TITLE: ClassVar[str] = "checkpoints"

    run_dir: str = opt("", "run directory (default runs/<config file stem>, or runs/default); keep it the "
                       "same across restarts so resume finds it")
    checkpoint_dir: str = opt("", "checkpoint directory (default RUN_DIR/checkpoints)")
    save_every: int = opt(1, "save a checkpoint every N epochs (0 = not by epoch)", min=0)
    save_every_steps: int = opt(0, "save a checkpoint every N optimizer steps (0 = off)", min=0)
    save_every_minutes: float = opt(0.0, "save a checkpoint every N minutes of wall time (0 = off)", min=0.0)
    keep_last: int = opt(3, "keep this many committed checkpoints (0 = keep all)", min=0)
    resume_from: str = opt("", "checkpoint dir to resume from (default: newest committed one in "
                           "checkpoint_dir, if any)")
    accept_config_change: bool = opt(False, "resume even though training settings (model, data, optimizer, "
                                     "lr, seed, ...) differ from the checkpoint's; by default such a resume is "
                                     "refused (exit 2)")
    auto_resume: bool = opt(True, "resume from the newest committed checkpoint in checkpoint_dir")
    async_checkpoint: bool = opt(False, "write checkpoints in a background thread")


@dataclass(frozen=True)
class EvalSettings(Section):
    """When to evaluate, early stopping, the best checkpoint, the moving average, time limits, callbacks."""

    TABLE: ClassVar[str] = "eval"
    TITLE: ClassVar[str] = "evaluation and stopping"

    eval_every_steps: int = opt(0, "also evaluate every N optimizer steps (0 = at each epoch's end only; a stream: "
                                "at the end only)", min=0)
    early_stop_metric: str = opt("", "stop when this eval metric (loss, accuracy, ...) has not improved for "
                                 "--early_stop_patience evaluations (empty = off)")
    early_stop_patience: int = opt(3, "early stopping: evaluations without improvement before the stop", min=1)
    early_stop_mode: Literal["min", "max"] = opt("min", "early stopping: whether lower or higher values of the metric are better")
    early_stop_min_delta: float = opt(0.0, "early stopping: the least change that counts as an improvement",
                                      min=0.0)
    keep_best: str = opt("", "keep the checkpoint with the best value of this eval metric (loss, accuracy, ...) as "
                         "CHECKPOINT_DIR/best, apart from --keep_last (empty = off)")
    keep_best_mode: Literal["min", "max"] = opt("min", "--keep_best: whether lower or higher values of the metric are better")
    load_best_at_end: bool = opt(False, "--keep_best: the final weights (model.safetensors, RUN_DIR/hf, RUN_DIR/adapter, "
                                 "model_ema.safetensors) are the best checkpoint's, not the last step's; the weights "
                                 "best/best.json names (the average for an ema_ metric)")
    ema_decay: float = opt(0.0, "keep an exponential moving average of the parameters with this decay (e.g. 0.999; "
                            "0 = off), saved in checkpoints and exported as RUN_DIR/model_ema.safetensors", min=0.0)
    ema_eval: bool = opt(False, "--ema_decay: also evaluate the average at each evaluation (ema_loss, "
                         "ema_accuracy, ... in the eval line)")
    max_time: str = opt("", "save and exit with code 75 (rerun to continue) once this much wall time has passed "
                        "since the launch: seconds or [D-]HH:MM:SS, below the scheduler's limit by the time a save "
                        "takes (empty = no limit)")
    callbacks: str = opt("", "comma-separated plug-ins 'pkg.mod:fn', each fn() -> a callback object "
                         "(see docs/callbacks.md)")

    def validate(self) -> None:
        super().validate()
        if self.max_time:
            parse_duration(self.max_time, "--max_time")
        if self.ema_decay >= 1.0:
            raise UsageError(f"--ema_decay {self.ema_decay}: must be below 1 (0.999 averages over ~1000 steps; 0 is off)")
        if self.load_best_at_end and not self.keep_best:
            raise UsageError("--load_best_at_end loads the checkpoint --keep_best keeps, which is off; set --keep_best "
                             "(e.g. loss)")
        if self.ema_eval and not self.ema_decay:
            raise UsageError("--ema_eval evaluates the moving average of --ema_decay, which is off; set --ema_decay "
                             "(e.g. 0.999)")


@dataclass(frozen=True)
class ObserveSettings(Section):
    """Logs, the profiler, trackers, progress and fault injection."""

    TABLE: ClassVar[str] = "observe"
    TITLE: ClassVar[str] = "observability"

    log_interval: int = opt(10, "log train metrics every N optimizer steps", min=1)
    enable_profiling: bool = opt(False, "record a torch.profiler window and write a trace per rank to "
                                 "RUN_DIR/traces/")
    profile_wait: int = opt(5, "profiler: steps to skip before warming up", min=0)
    profile_warmup: int = opt(2, "profiler: warmup steps (recorded, discarded)", min=0)
    profile_active: int = opt(3, "profiler: steps recorded into the trace", min=1)
    tensorboard: bool = opt(False, "write TensorBoard events to RUN_DIR/tb/ (needs the tensorboard package)")
    tracker: str = opt("", "experiment trackers rank 0 sends every metrics line to, comma-separated: mlflow, "
                       "wandb, tensorboard (= --tensorboard); one tracker run per run dir (docs/trackers.md)")
    mlflow_tracking_uri: str = opt("", "--tracker mlflow: the tracking server or store (default: "
                                   "MLFLOW_TRACKING_URI, else MLflow's default)")
    mlflow_experiment: str = opt("", "--tracker mlflow: the experiment (default: MLFLOW_EXPERIMENT_NAME, else "
                                 "'ddptrain')")
    wandb_project: str = opt("", "--tracker wandb: the project (default: WANDB_PROJECT, else 'ddptrain')")
    tracker_run_name: str = opt("", "the tracker run's name (default: the run dir's name)")
    tracker_log_model: bool = opt(False, "at the end of a finished run, send model.safetensors and config.toml to "
                                  "the trackers as artifacts")
    progress: bool = opt(True, "progress bar on rank 0 (only when stderr is a terminal)")
    peak_tflops: float = opt(0.0, "per-device peak TFLOP/s for MFU (0 = known GPU table, else no MFU)",
                             min=0.0)
    straggler_skew: float = opt(1.5, "name a rank as straggler when its step time exceeds the median by this "
                                "factor at 3 log steps in a row", min=1.0)
    record_sample_ids: bool = opt(False, "write the sample ids of every step to RUN_DIR/samples/rank-R.jsonl")
    inject_fault: str = opt("", "fault injection for tests and chaos runs, e.g. 'rank=1,step=5,kind=sigkill' "
                            "(see docs/checkpoints.md; also DDPTRAIN_FAULT)")

    def validate(self) -> None:
        super().validate()
        if self.inject_fault:
            FaultSpec.parse(self.inject_fault, source="--inject_fault")
        parse_trackers(self.tracker)  # an unknown tracker's name is a UsageError


@dataclass(frozen=True)
class PerformanceSettings(Section):
    """Speed and memory: activation checkpointing, memory format, compilation."""

    TABLE: ClassVar[str] = "performance"
    TITLE: ClassVar[str] = "performance"

    activation_checkpointing: bool = opt(False, "recompute each block's activations in backward instead of "
                                         "keeping them (the blocks FSDP shards: --fsdp_blocks, the model's "
                                         "fsdp_blocks, a transformers model's own), under ddp and fsdp")
    channels_last: bool = opt(False, "channels_last memory format for model and inputs")
    compile: bool = opt(False, "torch.compile the model (under fsdp/hsdp each block, before it is sharded)")



# The sections, by their [table] in a config file, in --help's order.
SECTIONS: dict[str, type[Section]] = {section.TABLE: section for section in (
    DataSettings, FinetuneSettings, TrainingSettings, ParallelSettings, CheckpointSettings, EvalSettings,
    ObserveSettings, PerformanceSettings)}
# Every setting's field, by its name (flag, config key, `fit` argument), and the section that owns it.
FIELDS: dict[str, Field] = {f.name: f for section in SECTIONS.values() for f in fields(section)}
OWNER: dict[str, str] = {f.name: table for table, section in SECTIONS.items() for f in fields(section)}

BUILTIN_TASKS = ("classification", "regression", "language_model")
BUILTIN_MODELS = ("mini_resnet", "mlp", "gpt")
FILE_DATASETS = ("cifar10", "cifar100", "imagefolder", "tokens")
BUILTIN_DATASETS = ("synthetic", "digits", "pydoc") + FILE_DATASETS
TEXT_DATASETS = ("pydoc", "tokens")  # token windows for language models (text.py)
# --lora_init: peft's init_lora_weights that leave the base as it is and draw from the seeded RNG.
LORA_INITS = ("true", "gaussian", "orthogonal", "false")
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
