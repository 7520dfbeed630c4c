"""Hugging Face models, tokenizers and datasets, the field's own formats, first-class:

- `--model hf:NAME_OR_DIR`: a transformers model for the task (a causal LM for `language_model`, sequence
  classification with `--num_classes` labels for `classification`): `from_pretrained` from a directory with
  weights (or a hub name, where the machine can download), `from_config` from a directory with a
  config.json alone (fresh weights, seeded like every model). FSDP units are the model's own
  `_no_split_modules`. At the end of a run, RUN_DIR/hf/ holds the `save_pretrained` layout (with the
  tokenizer, if one was given), so `AutoModelFor...from_pretrained(RUN_DIR / "hf")` loads the trained model;
  `ddptrain export CHECKPOINT --hf OUT_DIR` does the same for any checkpoint.
- `--dataset hf:PATH --tokenizer DIR`: records of a JSON lines or Parquet file or a `datasets.save_to_disk`
  directory, tokenized once into variable-length items (cached beside the data, keyed by the data, the
  tokenizer and the flags) that the default collate pads. For language models the records' shape decides, as
  in TRL: `--prompt_field` + `--response_field` when given, else `--text_field` (default `text`) where the
  records have it, else `prompt` + `completion`, else chat records in `--messages_field` (chat.py: a prompt
  and completion that are lists of turns are a conversation too); the prompt is masked from the loss.
  `--text_field` + `--label_field` for classification.
- `ddptrain prepare-text --tokenizer DIR`: token files for `--dataset tokens` (text.py).

transformers, tokenizers and datasets are the optional extra `pip install 'ddptrain[hf]'`, imported only
when an hf: flag asks for them; a missing one is a usage error naming the extra.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import importlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ddptrain.config import DataSettings
from ddptrain.errors import UsageError, first_line
from ddptrain.models import chat

PREFIX = "hf:"
HF_DIR = "hf"  # RUN_DIR/hf: the trained model in the save_pretrained layout
CACHE_FORMAT = "ddptrain-hf-tokenized/3"  # 2: the tokenizer's own special tokens, chat records; 3: as transformers
# renders a template ({% generation %} marks, tools, null fields dropped), prompt/completion by shape


def is_hf(ref: str) -> bool:
    return ref.startswith(PREFIX)


def is_transformers(module: nn.Module) -> bool:
    """Whether `module` is a transformers model (`--model hf:...`, or one a user built and passed to `fit`)."""
    return callable(getattr(module, "save_pretrained", None)) and hasattr(getattr(module, "config", None),
                                                                          "to_json_string")


def require(package: str, flag: str) -> Any:
    """Import `package` for `flag`, or a usage error naming the extra that installs it."""
    try:
        module = importlib.import_module(package)
    except ImportError:
        raise UsageError(f"{flag} needs the {package} package: pip install 'ddptrain[hf]'") from None
    if package == "datasets":
        module.disable_progress_bars()  # bars on stderr for each split and map: ddptrain logs one line instead
    if package == "transformers":  # "Loading weights" / "Writing model shards" bars from every rank, between lines
        module.utils.logging.disable_progress_bar()
    return module


# --- models ------------------------------------------------------------------------------------

def _auto_class(data: DataSettings) -> Any:
    transformers = require("transformers", f"--model {data.model}")
    if data.task == "language_model":
        return transformers.AutoModelForCausalLM
    if data.task == "classification":
        return transformers.AutoModelForSequenceClassification
    raise UsageError(f"--model {data.model}: a transformers model trains with --task language_model (a causal LM) "
                     f"or --task classification (sequence classification), not --task {data.task}")


def _has_weights(directory: Path) -> bool:
    return any(directory.glob("*.safetensors")) or any(directory.glob("pytorch_model*.bin"))


def check_model(data: DataSettings) -> None:
    """What can be known before any process starts: a local directory holds a config.json."""
    source = data.model[len(PREFIX):]
    if not source:
        raise UsageError("--model hf: name a model: hf:DIR (a save_pretrained directory, or one with a config.json) "
                         "or hf:ORG/NAME (a hub model)")
    if data.task not in ("language_model", "classification"):
        _auto_class(data)  # raises the task error
    path = Path(source)
    if not path.exists() and (source.startswith((".", "/", "~")) or source.count("/") > 1):
        # A path, not a hub name (ORG/NAME): the Hub's repo-id error would mislead.
        raise UsageError(f"--model {data.model}: no such directory {path}; pass a save_pretrained directory (or one "
                         "with a model's config.json)")
    if path.exists() and not (path / "config.json").is_file():
        raise UsageError(f"--model {data.model}: {path} has no config.json; pass a directory written by "
                         "save_pretrained, or one with a model's config.json")
    vocab, positions = model_limits(data)
    if positions is not None and data.task == "language_model" and data.seq_len > positions:
        raise UsageError(f"--seq_len {data.seq_len} is longer than --model {data.model}'s {positions} positions "
                         f"(config.json); pass --seq_len {positions} or less")
    if vocab is not None and data.tokenizer and (Path(data.tokenizer) / "tokenizer.json").is_file():
        tokens = load_tokenizer(data.tokenizer).vocab_size
        if tokens > vocab:
            raise UsageError(f"--tokenizer {data.tokenizer} has {tokens} tokens, more than --model {data.model}'s "
                             f"vocabulary of {vocab} (config.json): its ids would index past the embedding; use the "
                             "model's own tokenizer, or resize the model's embeddings")


def model_limits(data: DataSettings) -> tuple[int | None, int | None]:
    """(vocabulary size, positions) in the config.json of a local --model hf:DIR; None where it does not say (a
    hub name, a model with relative positions only)."""
    path = Path(data.model[len(PREFIX):]) / "config.json"
    if not path.is_file():
        return None, None
    config = json.loads(path.read_text())
    config = config.get("text_config", config)  # a multimodal model's language part
    positions = next((config[k] for k in ("max_position_embeddings", "n_positions", "n_ctx")
                      if isinstance(config.get(k), int)), None)
    return config.get("vocab_size") if isinstance(config.get("vocab_size"), int) else None, positions


def local_source(data: DataSettings) -> Path | None:
    """The local directory `--model hf:DIR` names if it holds a config.json and no weights or safetensors
    weights (what a model built on the meta device is filled from); None for a hub name or .bin weights."""
    path = Path(data.model[len(PREFIX):])
    if not (path / "config.json").is_file():
        return None
    if _has_weights(path) and not any(path.glob("*.safetensors")):
        return None
    return path


def pretrained_dir(data: DataSettings) -> Path | None:
    """The save_pretrained directory whose safetensors weights `--model` loads, or None (fresh weights)."""
    path = local_source(data)
    return path if path is not None and any(path.glob("*.safetensors")) else None


def build_model(data: DataSettings, on_meta: bool = False) -> nn.Module:
    """The transformers model `--model hf:...` names, in fp32 and in training mode. Call after seeding.
    `on_meta`: from the config alone under the caller's meta device: no weight is read or initialised."""
    auto = _auto_class(data)
    transformers = require("transformers", f"--model {data.model}")
    source = data.model[len(PREFIX):]
    path = Path(source)
    labels = {"num_labels": data.num_classes} if data.task == "classification" else {}
    try:
        if on_meta or (path.is_dir() and not _has_weights(path)):
            config = transformers.AutoConfig.from_pretrained(path, **labels)
            model = auto.from_config(config, dtype=torch.float32)
        else:  # a directory with weights, or a hub name (downloads where the machine can)
            model = auto.from_pretrained(source, dtype=torch.float32, **labels)
    except OSError as exc:  # not found locally, not on the hub, or offline
        reason = first_line(exc) or type(exc).__name__
        raise UsageError(f"--model {data.model}: cannot load it ({reason}); pass a local directory with a "
                         "config.json, or a hub name on a machine that can download it") from None
    model.config.use_cache = False  # training: no key/value cache in the outputs
    return model.train()  # from_pretrained returns a model in eval mode


def no_split_modules(module: nn.Module) -> set[str]:
    """The block classes a transformers model says must not be split (its FSDP units)."""
    return set(getattr(module, "_no_split_modules", None) or ())


def embedding_units(module: nn.Module) -> list[nn.Module]:
    """The input embedding and output head as FSDP units of their own when they are not tied (a tied pair must
    stay in one unit: the root). Vocabulary-sized, they would otherwise make the root unit the largest:
    gathered whole with its gradients and reduce buffers, a Llama's root unit is 4x its 41 % of the model."""
    inputs, outputs = module.get_input_embeddings(), module.get_output_embeddings()
    if outputs is not None and getattr(outputs, "weight", None) is getattr(inputs, "weight", None):
        return []
    return [unit for unit in (inputs, outputs) if isinstance(unit, nn.Module)]


def recomputes_itself(module: nn.Module) -> bool:
    """Whether `module` has transformers' own recomputation of each block in backward (gradient checkpointing,
    over its `_no_split_modules` blocks)."""
    return bool(getattr(module, "supports_gradient_checkpointing", False))


def enable_activation_checkpointing(module: nn.Module) -> None:
    """transformers' own recomputation of each block in backward (a model that `recomputes_itself`)."""
    module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def save_pretrained(data: DataSettings, state: dict[str, torch.Tensor], out_dir: Path,
                    module: nn.Module | None = None, source_config: Path | None = None) -> Path:
    """The save_pretrained layout of `state` (a whole model's weights) in `out_dir`, plus the tokenizer's
    files if --tokenizer named one. `module`: the live model (its config), else one rebuilt from the
    config.json in `source_config`, or the model's source."""
    if module is None:
        module = _skeleton(data, source_config)
        module.load_state_dict(state)
        state = None
    out_dir.mkdir(parents=True, exist_ok=True)
    module.save_pretrained(out_dir, state_dict=state)
    save_pretrained_files(data, module, out_dir)  # its config as for inference, as RUN_DIR/hf has it
    return out_dir


def copy_tokenizer(data: DataSettings, out_dir: Path) -> None:
    """The tokenizer's files beside the weights, if --tokenizer named one; with --chat_template, that template as
    the tokenizer's (chat_template.jinja, which transformers reads before tokenizer_config.json's): what the
    model was trained on is what `apply_chat_template` then formats with."""
    if data.tokenizer:
        for name in TOKENIZER_FILES:
            if (Path(data.tokenizer) / name).is_file():
                shutil.copyfile(Path(data.tokenizer) / name, out_dir / name)
        if data.chat_template:
            shutil.copyfile(data.chat_template, out_dir / chat.TEMPLATE_FILE)


def save_pretrained_files(data: DataSettings, module: nn.Module, out_dir: Path) -> None:
    """What save_pretrained writes besides the weights (config, generation config) and the tokenizer's files:
    with weights written in HF's layout beside them, `from_pretrained(out_dir)` loads the model. Configured for
    inference: training turned the key/value cache off (`load`), the files turn it back on."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = module.config
    # The dtype the weights beside it are written in: the model's own (--param_dtype bf16 casts it after it was
    # built from a config that says float32). transformers names it `dtype` since 4.56, `torch_dtype` before.
    field = "dtype" if hasattr(config, "dtype") else "torch_dtype"
    training, dtype = config.use_cache, getattr(config, field, None)
    config.use_cache = True
    written = {p.dtype for p in module.parameters() if p.is_floating_point()}
    if len(written) == 1:
        setattr(config, field, written.pop())
    try:
        config.save_pretrained(out_dir)
    finally:
        config.use_cache = training
        setattr(config, field, dtype)
    generation = getattr(module, "generation_config", None)
    if generation is not None and module.can_generate():
        generation = copy.deepcopy(generation)
        generation.use_cache = True
        generation.save_pretrained(out_dir)
    copy_tokenizer(data, out_dir)


def _skeleton(data: DataSettings, run_config: Path | None) -> nn.Module:
    """The model --model names, fresh: from the config.json the run left in `run_config`, or its source's."""
    transformers = require("transformers", "ddptrain export --hf")
    auto = _auto_class(data)
    source = Path(data.model[len(PREFIX):])
    for candidate in (run_config, source):
        if candidate is not None and (candidate / "config.json").is_file():
            return auto.from_config(transformers.AutoConfig.from_pretrained(candidate), dtype=torch.float32)
    try:
        return auto.from_config(transformers.AutoConfig.from_pretrained(str(source)), dtype=torch.float32)
    except OSError as exc:
        raise UsageError(f"--hf: the run's model {data.model} has no config.json to rebuild it from ({exc}); "
                         "pass a checkpoint whose model directory still exists") from None


# --- tokenizers -----------------------------------------------------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", chat.TEMPLATE_FILE)
# The named special tokens (transformers' special_tokens_map): what a chat template is given.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TextTokenizer:
    """A `tokenizers` tokenizer (tokenizer.json) with the special tokens its tokenizer_config.json names."""

    def __init__(self, directory: Path):
        tokenizers = require("tokenizers", "--tokenizer")
        self.directory = directory
        self.tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        special = {}
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if (directory / name).is_file():
                special.update({k: v.get("content") if isinstance(v, dict) else v  # {"content": "<pad>", ...}
                                for k, v in json.loads((directory / name).read_text()).items()
                                if k in SPECIAL_TOKENS and v})
        self.special = {k: v for k, v in special.items() if isinstance(v, str)}  # what a chat template may name
        self.pad_id = self._id(special.get("pad_token"))
        self.eos_id = self._id(special.get("eos_token"))
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.template_text = chat.read_template(directory)

    def _id(self, token: Any) -> int | None:
        return self.tokenizer.token_to_id(token) if isinstance(token, str) else None

    def encode(self, texts: list[str], special: bool = True) -> list[list[int]]:
        """Token ids of each text; `special`: with the special tokens the tokenizer adds to a text of its own (a
        Llama tokenizer's BOS), as `AutoTokenizer(text)` gives them at inference."""
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=special)]

    def encode_rendered(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """A chat template's rendering as token ids and each id's character span: no special tokens added (the
        template writes its own), as transformers' apply_chat_template encodes it."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def chat_template(self, data: DataSettings) -> chat.Template | None:
        """`--chat_template FILE`, else this tokenizer's own chat template, compiled; None if neither."""
        if data.chat_template:
            return chat.Template(chat.read_template_file(data.chat_template), self.special,
                                 f"--chat_template {data.chat_template}")
        if self.template_text is None:
            return None
        return chat.Template(self.template_text, self.special, f"--tokenizer {self.directory}'s chat template")

    def digest(self) -> str:
        return tokenizer_digest(self.directory)


def tokenizer_digest(directory: Path, chat_template: str = "") -> str:
    """sha256 of a tokenizer directory's files, and of the `--chat_template` file that formats the records in
    its place where one does: what the tokenized records (and a checkpoint) depend on."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (directory / name).is_file():
            h.update(name.encode() + (directory / name).read_bytes())
    if chat_template and Path(chat_template).is_file():
        h.update(b"--chat_template" + Path(chat_template).read_bytes())
    return h.hexdigest()


def load_tokenizer(directory: str, flag: str = "--tokenizer") -> TextTokenizer:
    path = Path(directory)
    if not directory:
        raise UsageError(f"{flag}: pass the directory of a Hugging Face tokenizer (tokenizer.json)")
    if not (path / "tokenizer.json").is_file():
        raise UsageError(f"{flag} {directory}: no tokenizer.json there; pass the directory a tokenizer was saved to "
                         "(tokenizers' Tokenizer.save or transformers' save_pretrained)")
    return TextTokenizer(path)


def pad_token_id(data: DataSettings, tokenizer: TextTokenizer | None) -> int:
    """--pad_token_id, else the tokenizer's pad token, else its end-of-text token, else 0."""
    if data.pad_token_id >= 0:
        return data.pad_token_id
    for found in ((tokenizer.pad_id, tokenizer.eos_id) if tokenizer is not None else ()):
        if found is not None:
            return found
    return 0


# --- datasets -------------------------------------------------------------------------------------

def _source(ref: str, flag: str) -> Path:
    path = Path(ref[len(PREFIX):] if ref.startswith(PREFIX) else ref)
    if not path.exists():
        raise UsageError(f"{flag} {ref}: no such file or directory; pass a .jsonl/.json or .parquet file, or a "
                         "directory written by datasets' save_to_disk")
    if path.is_file() and path.suffix not in (".jsonl", ".json", ".parquet"):
        raise UsageError(f"{flag} {ref}: {path.suffix or 'no suffix'} is not a format it reads; pass a .jsonl/.json "
                         "or .parquet file, or a datasets.save_to_disk directory")
    return path


def check_dataset(data: DataSettings) -> None:
    """The flags of an hf: dataset, before any process starts (the fields are checked against the data when it
    is tokenized)."""
    _source(data.dataset, "--dataset")
    if data.eval_data:
        _source(data.eval_data, "--eval_data")
    if data.task not in ("language_model", "classification"):
        raise UsageError(f"--dataset {data.dataset}: hf datasets are tokenized for --task language_model or "
                         f"classification, not --task {data.task}")
    if bool(data.prompt_field) != bool(data.response_field):
        raise UsageError("--prompt_field and --response_field go together (the prompt is masked, the response "
                         "learnt); pass both, or neither for --text_field")
    tokenizer = load_tokenizer(data.tokenizer)
    if data.chat_template:
        require("jinja2", "--chat_template")
        tokenizer.chat_template(data)  # read and compiled now: a mistake in the file is exit 2 before any process
    if data.model in ("gpt",) and data.vocab_size < tokenizer.vocab_size:
        raise UsageError(f"--vocab_size {data.vocab_size} is smaller than --tokenizer {data.tokenizer}'s vocabulary "
                         f"of {tokenizer.vocab_size}; pass --vocab_size {tokenizer.vocab_size}")
    require("datasets", f"--dataset {data.dataset}")


def _fields(data: DataSettings, columns: list[str] | None = None) -> list[str]:
    """The record fields the flags read; with `columns` (the data's), found by the records' shape as TRL finds
    them: where the records lack --text_field, `prompt` + `completion` if they have both, else --messages_field
    if they have it."""
    if data.task == "classification":
        return [data.text_field, data.label_field]
    if data.prompt_field:
        return [data.prompt_field, data.response_field]
    if columns is not None and data.text_field not in columns:
        if "prompt" in columns and "completion" in columns:
            return ["prompt", "completion"]
        if data.messages_field in columns:
            return [data.messages_field]
    return [data.text_field]


def _read(path: Path, flag: str, cache: Path) -> Any:
    """The records at `path` as one datasets.Dataset: a save_to_disk DatasetDict gives its train split (and
    keeps the others for `_held_out`)."""
    datasets = require("datasets", flag)
    if path.is_dir():
        try:
            data = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as exc:
            raise UsageError(f"{flag} {path}: not a datasets.save_to_disk directory ({exc})") from None
        return data
    if path.suffix == ".jsonl":
        _say_blank_lines(path, flag)
    if path.stat().st_size < 4096 and not path.read_bytes().strip():  # (datasets says "StopIteration")
        raise UsageError(f"{flag} {path}: the file is empty; give it one record per line (or a JSON list of them)")
    reader = datasets.Dataset.from_parquet if path.suffix == ".parquet" else datasets.Dataset.from_json
    try:
        return reader(str(path), cache_dir=str(cache / "raw"))
    except Exception as exc:  # malformed JSON lines, not Parquet: the file is at fault
        raise UsageError(f"{flag} {path}: cannot read it as {path.suffix[1:]} records ({type(exc).__name__}: "
                         f"{first_line(exc)})") from None


def _say_blank_lines(path: Path, flag: str) -> None:
    """JSON Lines readers skip blank lines: say so once, with the count, so that none vanishes unnoticed and a
    record's number (counted without them) is not taken for a line's."""
    with open(path, "rb") as fh:
        blank = [number for number, line in enumerate(fh, 1) if not line.strip()]
    if blank:
        print(f"ddptrain: {flag} {path}: {len(blank)} blank lines skipped (first: line {blank[0]}); records are "
              "numbered without them", flush=True)


def _splits(data: Any) -> tuple[Any, Any]:
    """(train records, the data's own validation or test split or None)."""
    if hasattr(data, "keys"):  # a DatasetDict
        names = list(data.keys())
        train = "train" if "train" in names else names[0]
        held = next((n for n in ("validation", "test", "eval") if n in names), None)
        return data[train], (data[held] if held else None)
    return data, None


class TokenizedRecords(Dataset):
    """Tokenized records, memory-mapped from the cache: item i is a dict of 1-D tensors (`input_ids`, and
    `labels` where the flags give them) or, for classification, `labels` a class index."""

    uses_global_rng = False

    def __init__(self, directory: Path, pad_id: int):
        datasets = require("datasets", "--dataset")
        self.directory = directory
        self.data = datasets.load_from_disk(str(directory)).with_format("torch")
        self.pad_token_id = pad_id

    def __len__(self) -> int:
        return len(self.data)

    def row_lengths(self) -> list[int]:
        """Each record's token count, from the lengths of its input_ids column (no record is read)."""
        import pyarrow.compute as pc

        return pc.list_value_length(self.data.data.column("input_ids")).to_pylist()

    def plan_file(self, seq_len: int, seed: int) -> Path:
        """Where --packing keeps its plan of these records' bins: beside them in the cache."""
        return self.directory.parent / f"bins-{self.directory.name}-{seq_len}-{seed}.json"

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.data[int(index)]


def _tokenize(records: Any, data: DataSettings, tokenizer: TextTokenizer, flag: str, path: Path) -> Any:
    """The records as token ids (and labels): a text or a string prompt and response tokenized as inference
    tokenizes a prompt (the tokenizer's own special tokens, a Llama's BOS) and ended by its end-of-text token; a
    conversation (chat records, or a prompt and completion that are lists of turns) formatted with the chat
    template (chat.py); cut to --seq_len."""
    fields = _fields(data, records.column_names)
    missing = [f for f in fields if f not in records.column_names]
    if missing:
        flags = {data.text_field: "--text_field", data.label_field: "--label_field", data.prompt_field: "--prompt_field",
                 data.response_field: "--response_field"}
        reads = ("--task classification reads --text_field and --label_field" if data.task == "classification" else
                 "--task language_model reads --text_field, --prompt_field with --response_field, prompt with "
                 f"completion, or chat records in --messages_field ({data.messages_field})")
        raise UsageError(f"{flags[missing[0]]} {missing[0]}: {flag} {path} has no such field (it has "
                         f"{', '.join(records.column_names)}; {reads})")
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    limit = data.seq_len
    template = None
    if data.task == "language_model" and fields != [data.text_field] and len(records) \
            and (fields == [data.messages_field] or isinstance(records[0][fields[0]], list)):
        template = tokenizer.chat_template(data)
        if template is None:
            raise UsageError(f"{flag} {path}: chat records ({', '.join(fields)}) need a chat template, and --tokenizer "
                             f"{data.tokenizer} has none (tokenizer_config.json's chat_template); pass one with "
                             "--chat_template FILE")
    prompt_field, response_field = fields if len(fields) == 2 else (None, None)

    def texts(batch: dict[str, list], field: str, first: int) -> list[str]:
        """The field's values, each a string: a null is the file's mistake, not the text "None"."""
        for i, value in enumerate(batch[field]):
            if not isinstance(value, str):
                raise UsageError(f"{flag} {path}: record {first + i} has {field} {json.dumps(value, default=str)[:40]}, "
                                 "not text; fix or drop that record")
        return batch[field]

    def rows(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        first = indices[0]
        if data.task == "classification":
            ids = [seq[:limit] for seq in tokenizer.encode(texts(batch, data.text_field, first))]
            return {"input_ids": ids, "labels": [int(label) for label in batch[data.label_field]]}
        out: dict[str, list] = {"input_ids": [], "labels": [], "prompt_tokens": []}
        if template is not None:
            for i in range(len(indices)):
                record = {name: values[i] for name, values in batch.items()}
                ids, labels, learnt_from = chat.tokenize_record(record, fields, template, tokenizer.encode_rendered,
                                                                data.train_on, f"{flag} {path}: record {first + i}")
                out["input_ids"].append(ids[:limit])
                out["labels"].append(labels[:limit])
                out["prompt_tokens"].append(learnt_from)
            return out
        if prompt_field is None:
            return {"input_ids": [(seq + eos)[:limit] for seq in tokenizer.encode(texts(batch, data.text_field, first))]}
        prompts = tokenizer.encode(texts(batch, prompt_field, first))
        responses = tokenizer.encode(texts(batch, response_field, first), special=False)
        for prompt, response in zip(prompts, responses):
            out["input_ids"].append((prompt + response + eos)[:limit])
            out["labels"].append(([-100] * len(prompt) + response + eos)[:limit])
            out["prompt_tokens"].append(len(prompt))
        return out

    tokenized = records.map(rows, batched=True, with_indices=True, remove_columns=records.column_names)
    if "prompt_tokens" in tokenized.column_names:
        _check_cut_off(tokenized["labels"], tokenized["prompt_tokens"], data, flag, path)
        tokenized = tokenized.remove_columns("prompt_tokens")
    return tokenized


# Why a record learns nothing however long --seq_len is (chat.tokenize_record's place of its first learnt token).
_NOTHING_TO_LEARN = {
    chat.NO_ASSISTANT_TURN: "no assistant turn (no message with role \"assistant\" to learn from: --train_on "
                            "assistant, the default, trains on those turns only)",
    chat.NOTHING_MARKED: "no token the chat template marks as the assistant's ({% generation %} ... "
                         "{% endgeneration %} encloses nothing of it)",
}


def _check_cut_off(labels: list[list[int]], prompt_tokens: list[int], data: DataSettings, flag: str, path: Path) -> None:
    """Records that teach nothing: a chat whose rendering has nothing to learn (its prompt_tokens a key of
    _NOTHING_TO_LEARN), or one whose every learnt token --seq_len cut off. All of them is exit 2 (the loss would be
    NaN), some of them one line each kind with the count and the first record."""
    empty = [i for i, row in enumerate(labels) if all(label == -100 for label in row)]
    cut = [i for i in empty if prompt_tokens[i] >= 0]
    untaught = {}  # why -> the records that learn nothing for that reason
    for code, why in _NOTHING_TO_LEARN.items():
        if found := [i for i in empty if prompt_tokens[i] == code]:
            untaught[why] = found
    if len(empty) == len(labels):
        if untaught:
            why, found = next(iter(untaught.items()))
            rest = ("" if len(found) == len(labels) else f" and the rest are cut off by --seq_len {data.seq_len}"
                    if len(found) + len(cut) == len(labels) else " and the rest learn nothing either")
            raise UsageError(f"{flag} {path}: {'every record has' if not rest else f'{len(found)} records have'} "
                             f"{why}{rest}; first: record {found[0]}")
        raise UsageError(f"--seq_len {data.seq_len}: every record of {flag} {path} has its response cut off (the "
                         f"longest prompt is {max(prompt_tokens)} tokens); raise --seq_len or shorten the prompts")
    for why, found in untaught.items():
        print(f"ddptrain: {len(found)} of {len(labels)} records of {flag} {path} have {why} (first: record "
              f"{found[0]}); they train nothing", flush=True)
    if cut:
        print(f"ddptrain: {len(cut)} of {len(labels)} records of {flag} {path} have their response cut off by "
              f"--seq_len {data.seq_len} (first: record {cut[0]}); they train nothing", flush=True)


def _key(data: DataSettings, path: Path, tokenizer: TextTokenizer) -> str:
    h = hashlib.sha256(CACHE_FORMAT.encode())
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        stat = file.stat()
        h.update(f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    h.update(tokenizer.digest().encode())
    h.update(json.dumps([data.task, _fields(data), data.messages_field, data.train_on, data.seq_len]).encode())
    if data.chat_template:
        h.update(chat.read_template_file(data.chat_template).encode())
    return h.hexdigest()[:16]


def _cache_root(path: Path, run_dir: Path) -> Path:
    """Beside the data (`DATA.ddptrain-cache/`), or in the run dir where the data's directory is read-only."""
    beside = path.parent / f"{path.name}.ddptrain-cache"
    try:
        beside.mkdir(exist_ok=True)
        return beside
    except OSError:
        fallback = run_dir / "tokenized"
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def prepare(data: DataSettings, run_dir: Path) -> tuple[Path, Path | None]:
    """Tokenize the train and eval records once: (train cache dir, eval cache dir or None). Every process may
    call it: the first builds under a lock, the others wait and find it built."""
    tokenizer = load_tokenizer(data.tokenizer)
    train_path = _source(data.dataset, "--dataset")
    eval_path = _source(data.eval_data, "--eval_data") if data.eval_data else None
    root = _cache_root(train_path, run_dir)
    key = _key(data, train_path, tokenizer) + (f"-{_key(data, eval_path, tokenizer)}" if eval_path else "")
    built = root / key
    with open(root / ".lock", "a") as lock:
        fcntl.lockf(lock, fcntl.LOCK_EX)
        try:
            if not (built / "done").is_file():
                _build(data, tokenizer, train_path, eval_path, root, built)
        finally:
            fcntl.lockf(lock, fcntl.LOCK_UN)
    return built / "train", (built / "eval") if (built / "eval").is_dir() else None


def _build(data: DataSettings, tokenizer: TextTokenizer, train_path: Path, eval_path: Path | None, root: Path,
           built: Path) -> None:
    tmp = root / f".{built.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    train, held = _splits(_read(train_path, "--dataset", root))
    if eval_path is not None:
        held, _ = _splits(_read(eval_path, "--eval_data", root))
    _tokenize(train, data, tokenizer, "--dataset", train_path).save_to_disk(str(tmp / "train"))
    if held is not None:
        _tokenize(held, data, tokenizer, "--eval_data" if eval_path else "--dataset",
                  eval_path or train_path).save_to_disk(str(tmp / "eval"))
    (tmp / "done").write_text(json.dumps({"format": CACHE_FORMAT, "records": len(train)}) + "\n")
    shutil.rmtree(built, ignore_errors=True)
    tmp.rename(built)
    shutil.rmtree(root / "raw", ignore_errors=True)  # datasets' own conversion cache: not needed any more
    # Said on stdout: this runs once, often in the launcher before any rank log exists.
    print(f"ddptrain: tokenized {train_path} with {data.tokenizer} into {built}", flush=True)


def build_datasets(data: DataSettings, run_dir: Path) -> tuple[Dataset, Dataset | None]:
    """(train, eval or None) of `--dataset hf:PATH`, tokenized (from the cache when it is there)."""
    train_dir, eval_dir = prepare(data, run_dir)
    pad_id = pad_token_id(data, load_tokenizer(data.tokenizer))
    return TokenizedRecords(train_dir, pad_id), (TokenizedRecords(eval_dir, pad_id) if eval_dir else None)
