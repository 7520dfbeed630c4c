"""The one TrainConfig: every component's settings section (settings.py), read from flags, TOML and `fit`.

Precedence: command line > ``--config FILE.toml`` > the sections' defaults. The command line is parsed by tyro
from the sections' types, every flag by its setting's own name (`--lr`, not `--training.lr`); a config file's
keys stand at the top level or in their section's `[table]`. Validation runs once, at the edge
(`resolve_config`), and every failure is a `UsageError` whose one line names the flag and the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import importlib
import os
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ddptrain.cliargs import FALSE, TRUE
from ddptrain.errors import UsageError
from ddptrain.settings import (BUILTIN_DATASETS, BUILTIN_MODELS, BUILTIN_TASKS, FIELDS, FILE_DATASETS, LORA_INITS,
                               OWNER, SECTIONS, TEXT_DATASETS, TRACKERS, CheckpointSettings, DataSettings, EvalSettings,
                               FinetuneSettings, ObserveSettings, ParallelSettings, PerformanceSettings, Section,
                               TrainingSettings, choices, parse_duration, parse_trackers, value_type)

__all__ = ["BUILTIN_DATASETS", "BUILTIN_MODELS", "BUILTIN_TASKS", "FILE_DATASETS", "LORA_INITS", "SECTIONS",
           "TEXT_DATASETS", "TRACKERS", "CheckpointSettings", "DataSettings", "EvalSettings", "FinetuneSettings",
           "ObserveSettings", "ParallelSettings", "PerformanceSettings", "TrainConfig", "TrainingSettings", "choices",
           "load_plugin", "load_toml", "parse_duration", "parse_trackers", "resolve_config", "settings_digest",
           "setting_changes", "to_toml"]


@dataclass(init=False)
class TrainConfig:
    """A run's settings: one section per component (`cfg.data`, `cfg.training`, `cfg.parallel`, ...; the classes
    in settings.py), each typed and checking its own fields.

    A setting is also read and written by its own name (`cfg.lr` is `cfg.training.lr`), the name its flag, config
    key and `fit` argument have, and `TrainConfig(lr=0.1, nproc=2)` builds one from such names (or from whole
    sections: `TrainConfig(training=...)`). `replace` is `dataclasses.replace` by those names.
    """

    data: DataSettings
    finetune: FinetuneSettings
    training: TrainingSettings
    parallel: ParallelSettings
    checkpoint: CheckpointSettings
    eval: EvalSettings
    observe: ObserveSettings
    performance: PerformanceSettings

    def __init__(self, **values: Any) -> None:
        given = {name: values.pop(name) for name in SECTIONS if name in values}
        unknown = sorted(set(values) - FIELDS.keys())
        if unknown:
            raise TypeError(f"TrainConfig got unknown settings {', '.join(unknown)}")
        for table, kind in SECTIONS.items():
            own = {name: value for name, value in values.items() if OWNER[name] == table}
            section = given.get(table)
            object.__setattr__(self, table, dataclasses.replace(section, **own) if section is not None else kind(**own))

    def __getattr__(self, name: str) -> Any:
        table = OWNER.get(name)
        if table is None or table not in self.__dict__:  # (not a setting; or a copy not yet filled in)
            raise AttributeError(f"TrainConfig has no setting {name!r}")
        return getattr(self.__dict__[table], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in OWNER:  # (a section is frozen: the config holds a new one, a component keeps what it was given)
            object.__setattr__(self, OWNER[name], dataclasses.replace(getattr(self, OWNER[name]), **{name: value}))
        else:
            object.__setattr__(self, name, value)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with `changes` (settings by name) applied; this one is left as it is."""
        return TrainConfig(**{**self.to_dict(), **changes})

    @property
    def checkpoint_path(self) -> Path:
        return Path(self.checkpoint_dir) if self.checkpoint_dir else Path(self.run_dir) / "checkpoints"

    def to_dict(self) -> dict[str, Any]:
        """Every setting by name, section by section: what a checkpoint records and `TrainConfig(**...)` reads."""
        return {name: getattr(self, name) for name in FIELDS}

    def section(self, name: str) -> Section:
        """One component's settings by its [table] name ("data", "parallel", ...): a component is built from it
        alone."""
        if name not in SECTIONS:
            raise KeyError(f"no section {name!r}; the sections are {', '.join(SECTIONS)}")
        return getattr(self, name)

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
        chosen = self.lr != FIELDS["lr"].default or self.base_batch_size != FIELDS["base_batch_size"].default
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
            given = {name for name, f in FIELDS.items() if getattr(self, name) != f.default}
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
        """Each section's own rules, then those that join two sections; a UsageError names the flag and the fix.

        The config alone, changed in nothing: `preflight.check` checks devices, plug-ins, files, packages and
        checkpoints against it.
        """
        for table in SECTIONS:
            self.section(table).validate()
        if self.sync_batchnorm and self.backend == "gloo":
            raise UsageError(SYNC_BATCHNORM_ON_CPU)
        if self.strategy != "ddp":
            for flag, value, why in (("amp_dtype fp16", self.use_amp and self.amp_dtype == "fp16",
                                      "use --amp_dtype bf16 (FSDP's policy: bf16 compute, fp32 reduction)"),
                                     ("sync_batchnorm", self.sync_batchnorm, "it is a DDP setting; drop it")):
                if value:
                    raise UsageError(f"--{flag} does not apply to --strategy {self.strategy}: {why}")
            for flag in self.finetune.needs_whole_base():
                raise UsageError(f"{flag} works with --strategy ddp only (under {self.strategy} no rank holds the "
                                 "base's whole weights it is computed from); pass --strategy ddp")
        if self.tp > 1:
            self._check_tensor_parallel()
        if self.static_graph and self.grad_accum_steps > 1:
            # DDP's static graph counts one gradient-ready hook per parameter per iteration; no_sync's
            # extra backward passes break that count (a torch internal assert, reproduced on 2.13).
            raise UsageError("--static_graph cannot be combined with --grad_accum_steps > 1 (DDP's static graph "
                             "does not support no_sync accumulation); drop one of the two flags")

    def _check_tensor_parallel(self) -> None:
        """--tp's rules that join sections: the models with a plan, what is not combined with it yet."""
        if self.model != "gpt" and not self.model.startswith("hf:"):
            raise UsageError(f"--tp {self.tp}: --model {self.model} has no tensor-parallel plan (the built-in gpt "
                             "has one, and transformers models with a base_model_tp_plan); pass --tp 1")
        if self.model == "gpt" and self.num_heads % self.tp:
            raise UsageError(f"--tp {self.tp} splits the attention heads over the ranks of a group: --num_heads "
                             f"{self.num_heads} must be a multiple of it; pass --num_heads "
                             f"{self.num_heads // self.tp * self.tp or self.tp}")
        # LoRA's adapters split with their base layers (models/lora.py, TP_SPLIT_ADAPTER), but not yet: dropout
        # (the ranks of a group would drop other inputs of one adapter), DoRA (its norm is of the whole weight).
        if self.lora_rank and self.lora_dropout:
            raise UsageError(f"--lora_dropout {self.lora_dropout} does not compose with --tp {self.tp} yet (the ranks "
                             "of a tensor-parallel group would drop different inputs of one adapter): pass "
                             "--lora_dropout 0, or --tp 1")
        if self.lora_rank and self.lora_dora:
            raise UsageError(f"--lora_dora does not compose with --tp {self.tp} yet (DoRA's magnitude divides by the "
                             "norm of the whole weight, which a tensor-parallel group splits): drop --lora_dora, or "
                             "pass --tp 1")


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

def coerce(name: str, value: Any, source: str) -> Any:
    """A setting's value read from a config file or given to `fit`, as its field's type (an int where a float is
    expected becomes that float); anything else is a UsageError naming `source` and the setting."""
    want = value_type(SECTIONS[OWNER[name]], name)
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
        if key not in FIELDS:
            hint = difflib.get_close_matches(key, FIELDS, n=1)
            fix = f"did you mean {hint[0]!r}?" if hint else "see `ddptrain train --help` for the keys"
            raise UsageError(f"--config {path}: unknown key {key!r}; {fix}")
        if key in out:
            raise UsageError(f"--config {path}: {key} is set twice (at the top level and in [{OWNER[key]}]); keep one")
        out[key] = coerce(key, value, f"--config {path}")
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
            if inner in OWNER and OWNER[inner] != key:
                raise UsageError(f"--config {path}: {inner} belongs in [{OWNER[inner]}], not [{key}] (or at the top "
                                 "level)")
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
    """The resolved config as TOML that `--config` reads back unchanged: every key at the top level, as
    RUN_DIR/config.toml has always been read (`tomllib.load(...)["width"]`), under a comment naming its section."""
    lines = ["# Resolved ddptrain config (defaults < --config file < command line)."]
    for table, section in SECTIONS.items():
        lines += ["", f"# [{table}] {section.TITLE}"] + [f"{f.name} = {toml_value(getattr(cfg, f.name))}"
                                                        for f in dataclasses.fields(section)]
    return "\n".join(lines) + "\n"


# --- command line --------------------------------------------------------------------------------

DESCRIPTION = ("Train on 1..N processes. Flags override --config FILE.toml (settings by these names, at the top "
               "level or in their section's [table]), which overrides the defaults. A switch is --x, --no-x, or "
               "--x true/false.")


def resolve_config(argv: list[str], *, validate: bool = True, prog: str = "ddptrain train") -> TrainConfig:
    """Defaults < TOML file < flags, then validation. The only way a TrainConfig is made from user input."""
    argv, config_file = _config_file(list(argv))
    values = load_toml(config_file) if config_file else {}
    argv, flagged = _switches(argv, prog)
    cfg = _parse(argv, TrainConfig(**values), prog)
    given = set(values) | flagged
    if not cfg.run_dir:
        # Runs without a config file get a dir of their own per set of training settings: the same command run
        # again (a restart, a requeue) finds its checkpoints, another command does not train on top of them.
        name = Path(config_file).stem if config_file else f"default-{settings_digest(cfg)}"
        cfg.run_dir = str(Path("runs") / name)
    if validate:
        cfg.settle(given)
        cfg.validate()
        refuse_ignored(cfg, flagged)
    return cfg


def _config_file(argv: list[str]) -> tuple[list[str], str]:
    """`--config FILE` (or `--config=FILE`) taken out of `argv`: (the other arguments, FILE or "")."""
    for i, arg in enumerate(argv):
        if arg == "--config":
            if i + 1 == len(argv):
                raise UsageError("--config expects a TOML file; see `ddptrain train --help`")
            return argv[:i] + argv[i + 2:], argv[i + 1]
        if arg.startswith("--config="):
            return argv[:i] + argv[i + 1:], arg.split("=", 1)[1]
    return argv, ""


def _switches(argv: list[str], prog: str) -> tuple[list[str], set[str]]:
    """`argv` with every switch spelled as tyro reads it (`--x true` -> `--x`, `--x false` -> `--no-x`), and the
    settings it names (what the command line decides, even at their default)."""
    out, named, i = [], set(), 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        flag, eq, value = arg.partition("=")
        negated = flag.startswith(("--no-", "--no_")) and flag[5:].replace("-", "_") in FIELDS
        name = (flag[5:] if negated else flag[2:]).replace("-", "_")
        if not flag.startswith("--") or name not in FIELDS:
            out.append(arg)
            continue
        named.add(name)
        if value_type(SECTIONS[OWNER[name]], name) is not bool:
            out.append(arg)
            continue
        if not eq and i < len(argv) and not argv[i].startswith("-"):  # (every setting is a flag: this is its value)
            value, eq, i = argv[i], "=", i + 1
        if negated and eq:
            raise UsageError(f"{flag} takes no value (got {value!r}); pass {flag}, or --{name} {value}")
        if eq and value.lower() not in TRUE + FALSE:
            raise UsageError(f"--{name} {value}: not true or false; pass --{name} (true), --no-{name} (false), or "
                             f"--{name} false")
        out.append(f"--{name}" if not negated and (not eq or value.lower() in TRUE) else f"--no-{name}")
    return out, named


def _parse(argv: list[str], defaults: TrainConfig, prog: str) -> TrainConfig:
    """The flags in `argv` over `defaults`, parsed by tyro from the sections' types; a bad flag or value is a
    UsageError of one line."""
    import tyro  # (here, not at the top: only a command line needs it)

    def one_line(event: Any) -> None:
        raise UsageError(_complaint(event, prog))

    try:
        from tyro._errors import on_parse_error  # tyro's hook to take a parse failure over (tyro 1.0)
    except ImportError:  # another tyro: its own report, exit 2 as well
        hooked = contextlib.nullcontext()
    else:
        hooked = on_parse_error(one_line)
    with hooked:
        return tyro.cli(tyro.conf.OmitArgPrefixes[TrainConfig], args=argv, default=defaults, prog=prog,
                        description=DESCRIPTION, use_underscores=True)


def _complaint(event: Any, prog: str) -> str:
    """One line for a tyro parse failure: the flag, what is wrong, and where to look."""
    argument = getattr(event, "argument", None)
    flag = argument.lowered.name_or_flags[0] if argument is not None else ""
    kind = type(event).__name__
    if kind == "UnrecognizedArgs":
        unknown = event.tokens[0]
        if not unknown.startswith("-"):
            return f"unexpected argument {unknown!r} (every setting is a --flag VALUE); see `{prog} --help`"
        hint = difflib.get_close_matches(unknown.split("=")[0].replace("-", "_").replace("__", "--"),
                                         [f"--{name}" for name in FIELDS] + ["--config"], n=1)
        return f"unknown flag {unknown}; " + (f"did you mean {hint[0]}?" if hint else f"see `{prog} --help`")
    if kind == "InvalidChoice":
        return f"{flag}: {event.value!r} is not one of {', '.join(event.choices)}"
    if kind == "InstantiationFailure" and flag:
        name = flag[2:]
        return (f"{flag} expects {value_type(SECTIONS[OWNER[name]], name).__name__} ({event.message}); see "
                f"`{prog} --help`")
    if kind == "BadValue":
        return f"{flag} expects a value; see `{prog} --help`"
    return f"{getattr(event, 'message', kind)}; see `{prog} --help`"
