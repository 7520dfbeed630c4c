"""Token streams for language models: flat token files read with np.memmap, served as fixed windows.

A token directory, as `ddptrain prepare-text` writes it::

    meta.json        {"format": "ddptrain-tokens/1", "dtype": "uint16", "vocab_size": 256,
                      "tokenizer": "bytes", "end_of_document": null (a tokenizer's: its end-of-text id),
                      "train": ["train-00000.bin", ...], "eval": ["eval-00000.bin"]}
    train-00000.bin  flat little-endian tokens, one shard after another (as large corpora are stored)

Sample i of a split is window i: `seq_len + 1` consecutive tokens of one shard (the model reads the first
`seq_len`, and predicts each next one), windows stepping by `seq_len` and never crossing a shard. A split
is then an ordinary map-style dataset, so the global sample cursor gives token streams the same
guarantees as images: bit-exact resume and sample-exact world-size changes. With --packing, a window's
documents (each ended by the tokenizer's end-of-text token) are kept apart as a packed row's are. `--dataset pydoc` serves the
English text that ships with CPython (`pydoc_data.topics`, ~466k bytes) the same way, bytes as tokens.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import torch
from torch.utils.data import Dataset

from ddptrain.cliargs import ArgParser
from ddptrain.config import DataSettings
from ddptrain.data.packing import documents_apart
from ddptrain.errors import UsageError
from ddptrain.models import hf

FORMAT = "ddptrain-tokens/1"
DTYPES = ("uint16", "uint32")
EVAL_FRACTION = 0.1  # of pydoc's text, and prepare-text's default


class TokenWindows(Dataset):
    """Windows of `seq_len + 1` tokens over one or more flat token arrays (memory-mapped files); with `end` (the
    token that ends each document: --packing), each window as a packed row whose documents are kept apart."""

    uses_global_rng = False  # a window is a slice: nothing random

    def __init__(self, shards: list[np.ndarray], seq_len: int, end: int | None = None):
        self.shards, self.seq_len, self.end = shards, seq_len, end
        self.documents_apart = end is not None
        counts = [max(0, (len(shard) - 1) // seq_len) for shard in shards]
        self.starts = np.cumsum([0] + counts).tolist()  # window index where each shard begins

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(index)
        shard = bisect.bisect_right(self.starts, index) - 1
        offset = (index - self.starts[shard]) * self.seq_len
        window = torch.from_numpy(self.shards[shard][offset:offset + self.seq_len + 1].astype(np.int64))
        return window if self.end is None else documents_apart(window, self.end)


def pydoc_tokens() -> np.ndarray:
    """CPython's pydoc topics as bytes, topics in sorted order: the same corpus on every machine."""
    text = "\n\n".join(topics[key] for key in sorted(topics))
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def read_meta(data_dir: str) -> dict:
    """The token directory's meta.json, checked; UsageError naming the file and the fix."""
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise UsageError(f"--data_dir {data_dir}: no meta.json; write token files with `ddptrain prepare-text "
                         f"{data_dir} FILE...`")
    try:
        meta = json.loads(path.read_text())
    except ValueError as exc:
        raise UsageError(f"{path}: not valid JSON ({exc})") from None
    listed = [meta.get(key, []) for key in ("train", "eval")] if isinstance(meta, dict) else [None]
    if (not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("dtype") not in DTYPES
            or not isinstance(meta.get("vocab_size"), int) or not meta.get("train")
            or not all(isinstance(names, list) and all(isinstance(n, str) for n in names) for names in listed)):
        raise UsageError(f"{path}: not a {FORMAT} meta.json (a dtype of {', '.join(DTYPES)}, an integer vocab_size, "
                         "lists of train and eval file names)")
    for name in meta["train"] + meta.get("eval", []):
        shard = Path(data_dir) / name
        if not shard.is_file():
            raise UsageError(f"{path} lists {name}, which is missing from --data_dir {data_dir}")
        if shard.stat().st_size % np.dtype(meta["dtype"]).itemsize:
            raise UsageError(f"{shard}: size is not a whole number of {meta['dtype']} tokens (truncated?)")
    return meta


def check(data: DataSettings) -> None:
    """Config against the token source: the vocabulary must hold every token id; --packing needs the token that
    ends each document."""
    vocab = 256 if data.dataset == "pydoc" else read_meta(data.data_dir)["vocab_size"]
    if data.packing:
        end_of_document(data)
    if data.model.startswith("hf:"):  # the model's own vocabulary, not the gpt-only --vocab_size
        model_vocab, _ = hf.model_limits(data)
        if model_vocab is not None and model_vocab < vocab:
            raise UsageError(f"--dataset {data.dataset}'s vocabulary of {vocab} tokens is larger than --model "
                             f"{data.model}'s {model_vocab}: its ids would index past the embedding; tokenize with "
                             "the model's own tokenizer")
        return
    if data.vocab_size < vocab:
        raise UsageError(f"--vocab_size {data.vocab_size} is smaller than --dataset {data.dataset}'s vocabulary of "
                         f"{vocab} tokens; pass --vocab_size {vocab}")


def end_of_document(data: DataSettings) -> int:
    """The token that ends each document of `--dataset tokens` (prepare-text records its tokenizer's
    end-of-text token); a UsageError where none is recorded."""
    meta = read_meta(data.data_dir)
    end = meta.get("end_of_document")
    if not isinstance(end, int):
        raise UsageError(f"--packing: {Path(data.data_dir) / 'meta.json'} records no end_of_document token, so the "
                         "documents of a window cannot be told apart; write the files with `ddptrain prepare-text "
                         "--tokenizer DIR` (a tokenizer with an end-of-text token), or drop --packing")
    return end


def build(data: DataSettings) -> tuple[Dataset, Dataset | None]:
    """(train, eval or None) windows for `--dataset pydoc` or `--dataset tokens`."""
    check(data)
    if data.dataset == "pydoc":
        tokens = pydoc_tokens()
        split = int(len(tokens) * (1 - EVAL_FRACTION))
        return TokenWindows([tokens[:split]], data.seq_len), TokenWindows([tokens[split:]], data.seq_len)
    meta = read_meta(data.data_dir)
    open_shards = lambda names: [np.memmap(Path(data.data_dir) / n, dtype=meta["dtype"], mode="r")  # noqa: E731
                                 for n in names]
    end = end_of_document(data) if data.packing else None
    train = TokenWindows(open_shards(meta["train"]), data.seq_len, end)
    held_out = TokenWindows(open_shards(meta["eval"]), data.seq_len, end) if meta.get("eval") else None
    return train, held_out


# --- `ddptrain prepare-text` ---------------------------------------------------------------------

def main(argv: list[str]) -> int:
    parser = ArgParser(prog="ddptrain prepare-text",
                       description="Turn text files into token files for --dataset tokens: bytes, or the tokens of a "
                                   "Hugging Face tokenizer (--tokenizer DIR).")
    parser.add_argument("out_dir", help="directory to write meta.json and the .bin shards into")
    parser.add_argument("files", nargs="+", help="UTF-8 text files, read in the order given")
    parser.add_argument("--eval_fraction", type=float, default=EVAL_FRACTION,
                        help=f"share of the tokens, from the end, held out for eval (default {EVAL_FRACTION})")
    parser.add_argument("--shard_tokens", type=int, default=1 << 27,
                        help="tokens per shard file (default 134217728: 256 MiB of uint16)")
    parser.add_argument("--tokenizer", default="", metavar="DIR",
                        help="a Hugging Face tokenizer directory (tokenizer.json); each file's text is tokenized "
                             "and ends with the tokenizer's end-of-text token (default: bytes)")
    args = parser.parse_args(argv)
    if not 0 <= args.eval_fraction < 1:
        raise UsageError(f"--eval_fraction must be in [0, 1) (got {args.eval_fraction})")
    if args.shard_tokens < 2:
        raise UsageError(f"--shard_tokens must be >= 2 (got {args.shard_tokens})")
    for name in args.files:
        if not Path(name).is_file():
            raise UsageError(f"{name}: no such file; pass text files to tokenize")
    tokens, vocab, tokenizer, end = _tokens(args.files, args.tokenizer)
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    tokens = tokens.astype(dtype)
    split = len(tokens) - int(len(tokens) * args.eval_fraction)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "dtype": dtype, "vocab_size": vocab, "tokenizer": tokenizer, "end_of_document": end,
            "train": [], "eval": []}
    for split_name, part in (("train", tokens[:split]), ("eval", tokens[split:])):
        for number, start in enumerate(range(0, len(part), args.shard_tokens)):
            name = f"{split_name}-{number:05d}.bin"
            part[start:start + args.shard_tokens].tofile(out / name)
            meta[split_name].append(name)
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {split:,} train and {len(tokens) - split:,} eval tokens ({len(meta['train'])} + "
          f"{len(meta['eval'])} shards) to {out}; train with --task language_model --model gpt --dataset tokens "
          f"--data_dir {out} --vocab_size {vocab}")
    return 0


def _tokens(files: list[str], tokenizer_dir: str) -> tuple[np.ndarray, int, str, int | None]:
    """(every file's tokens, one after another; the vocabulary size; what made them; the token that ends each
    file's, or None)."""
    if not tokenizer_dir:
        tokens = np.concatenate([np.frombuffer(Path(n).read_bytes(), dtype=np.uint8) for n in files])
        return tokens, 256, "bytes", None
    tokenizer = hf.load_tokenizer(tokenizer_dir)
    end = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    ids = []
    for name in files:
        try:
            text = Path(name).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise UsageError(f"{name}: not UTF-8 text ({exc.reason} at byte {exc.start}); pass text files") from None
        ids.append(np.asarray(tokenizer.encode([text], special=False)[0] + end, dtype=np.int64))
    return np.concatenate(ids), tokenizer.vocab_size, str(Path(tokenizer_dir).resolve()), tokenizer.eos_id
