"""Packing (`--packing`): variable-length token rows placed into bins of `--seq_len` tokens, so that a batch holds
documents, not padding.

A bin is a row of several documents back to back. What keeps it exact (each document trained as if it were alone):

- `position_ids` restart at 0 in every document, and there is no `attention_mask`: transformers reads that as
  documents (its sdpa, eager and flex masks become block-diagonal; FlashAttention takes the boundaries as varlen
  lengths), and the built-in gpt builds the same block-diagonal mask from them (models.GPT);
- the first label of every document is -100: the task shifts labels by one, and the last token of one document
  must not be trained to predict the first of the next;
- labels keep their meaning (a masked prompt, a chat's assistant-only tokens), and the loss stays a sum over the
  tokens that count, so a packed and a padded run weigh every token alike.

The bins are planned once from the rows' lengths (best-fit decreasing: the longest rows first, each into the
fullest bin it fits; equal lengths in an order drawn from the seed), and the packed set is an ordinary map-style
dataset of bins: the global sample order, exact resume and a change of world size need nothing new. Each bin is
padded to `--seq_len` (one more "document" of labels -100), so every row of every batch has the same shape.

Token streams (`--dataset tokens`) have no padding to save: their windows are full. There --packing keeps each
window's documents apart the same way (`documents_apart`), the ends of documents read from the end-of-text token
that `ddptrain prepare-text --tokenizer` wrote after each file.
"""

from __future__ import annotations

import hashlib
import heapq
import inspect
import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, IterableDataset

from ddptrain.errors import UsageError

log = logging.getLogger("ddptrain")

IGNORE = -100


def plan_bins(lengths: Sequence[int], capacity: int, seed: int) -> list[list[int]]:
    """Best-fit decreasing: rows (indices into `lengths`) into bins of at most `capacity` tokens. Each row, longest
    first, goes into the bin with the least room that still holds it (a new bin if none does); rows of equal
    length go in an order drawn from `seed`, bins are numbered as they open. Deterministic from the lengths, the
    capacity and the seed: every rank plans the same bins. O(rows x log² capacity)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"row lengths must be within 1..{capacity}")
    tiebreak = np.random.default_rng(seed).permutation(len(lengths))
    order = np.lexsort((tiebreak, -lengths))  # longest first; equal lengths by the seeded draw
    bins: list[list[int]] = []
    room = _Rooms(capacity)
    for row in order.tolist():
        need = int(lengths[row])
        found = room.take(need)  # the bin with the least room >= need
        if found is None:
            bins.append([row])
            room.put(capacity - need, len(bins) - 1)
        else:
            left, index = found
            bins[index].append(row)
            room.put(left - need, index)
    return bins


class _Rooms:
    """Open bins by the room they have left: `take(n)` removes and returns (room, bin) of the bin with the least
    room >= n (the lowest-numbered of those), `put` files one. A segment tree over the room sizes finds it in
    O(log² capacity)."""

    def __init__(self, capacity: int):
        self.size = 1
        while self.size < capacity + 1:
            self.size *= 2
        self.count = [0] * (2 * self.size)  # open bins per room size, summed up the tree
        self.bins: list[list[int]] = [[] for _ in range(capacity + 1)]  # per room size: bins, a heap by number

    def put(self, room: int, index: int) -> None:
        if room <= 0:
            return  # a full bin takes nothing more
        heapq.heappush(self.bins[room], index)
        node = self.size + room
        while node:
            self.count[node] += 1
            node //= 2

    def take(self, need: int) -> tuple[int, int] | None:
        room = self._first_at_least(need)
        if room is None:
            return None
        index = heapq.heappop(self.bins[room])
        node = self.size + room
        while node:
            self.count[node] -= 1
            node //= 2
        return room, index

    def _first_at_least(self, need: int) -> int | None:
        """The smallest room size >= need with an open bin, or None."""
        node, low, high = 1, 0, self.size - 1
        if need > high or not self._any(1, low, high, need):
            return None
        while low != high:
            mid = (low + high) // 2
            if self._any(2 * node, low, mid, need):
                node, high = 2 * node, mid
            else:
                node, low = 2 * node + 1, mid + 1
        return low

    def _any(self, node: int, low: int, high: int, need: int) -> bool:
        """Whether the subtree `node` (room sizes low..high) holds an open bin of room >= need."""
        if high < need or not self.count[node]:
            return False
        if low >= need:
            return True
        mid = (low + high) // 2
        return self._any(2 * node, low, mid, need) or self._any(2 * node + 1, mid + 1, high, need)


def row_lengths(dataset: Any) -> list[int]:
    """The token count of each row: the dataset's own `row_lengths()` where it has one (tokenized records read it
    from their columns), else each row read once."""
    own = getattr(dataset, "row_lengths", None)
    if own is not None:
        return list(own())
    return [len(_ids(dataset[i], i)) for i in range(len(dataset))]


def _ids(item: Any, index: int) -> torch.Tensor:
    """A row's `input_ids` as a 1-D tensor; a UsageError naming the row if it is no such row."""
    if not isinstance(item, Mapping) or "input_ids" not in item:
        raise UsageError(f"--packing: row {index} of the dataset is a {type(item).__name__}, not a dict with "
                         "input_ids (and optional labels): packing places token rows of their own lengths")
    ids = torch.as_tensor(item["input_ids"])
    if ids.dim() != 1:
        raise UsageError(f"--packing: row {index} has input_ids of shape {list(ids.shape)}; give each row's tokens "
                         "as a 1-D sequence")
    return ids


class PackedRows(Dataset):
    """The bins of `rows` as a map-style dataset: item i is a dict of (seq_len,) tensors, `input_ids`,
    `labels` and `position_ids`, bin i's documents back to back and padded to `seq_len` (see the module's
    docstring). `uses_global_rng` follows the rows' dataset."""

    documents_apart = True  # what the loop checks the model can keep (`check_model`)

    def __init__(self, rows: Dataset, bins: list[list[int]], seq_len: int, pad_id: int):
        self.rows, self.bins, self.seq_len, self.pad_token_id = rows, bins, seq_len, pad_id
        self.uses_global_rng = getattr(rows, "uses_global_rng", True)

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, labels, positions = [], [], []
        for row in self.bins[index]:
            item = self.rows[row]
            row_ids = _ids(item, row)
            mask = item.get("attention_mask")
            if mask is not None and not bool(torch.as_tensor(mask).all()):
                raise UsageError(f"--packing: row {row} of the dataset is padded (its attention_mask has zeros); "
                                 "give rows of their own length, unpadded")
            row_labels = torch.as_tensor(item["labels"]) if "labels" in item else row_ids
            if row_labels.shape != row_ids.shape:
                raise UsageError(f"--packing: row {row} has {len(row_labels)} labels for {len(row_ids)} input_ids")
            row_labels = row_labels.clone()
            row_labels[0] = IGNORE  # nothing before it in its document predicts it
            ids.append(row_ids)
            labels.append(row_labels)
            positions.append(torch.arange(len(row_ids)))
        left = self.seq_len - sum(len(part) for part in ids)
        if left < 0:
            raise UsageError(f"--packing: the rows of bin {index} ({self.bins[index]}) now hold {-left} tokens more "
                             f"than --seq_len {self.seq_len}: the dataset's rows changed length since the bins were "
                             "planned (give rows of fixed lengths)")
        if left:  # the padding: a document of its own that nothing learns from
            ids.append(torch.full((left,), self.pad_token_id, dtype=ids[0].dtype))
            labels.append(torch.full((left,), IGNORE, dtype=labels[0].dtype))
            positions.append(torch.arange(left))
        return {"input_ids": torch.cat(ids), "labels": torch.cat(labels), "position_ids": torch.cat(positions)}


def documents_apart(window: torch.Tensor, end: int) -> dict[str, torch.Tensor]:
    """A window of `seq_len + 1` tokens cut from a stream of documents, each ended by the token `end` (`--dataset
    tokens`), as a packed row: `input_ids` the first `seq_len` tokens, `position_ids` restarting after every end
    token, and `labels` the whole window (one longer than `input_ids`: label t + 1 is position t's target), -100
    on the token after an end, which nothing of its own document precedes. The window's first document began
    before it, as without --packing."""
    ids = window[:-1]
    ends = ids == end
    place = torch.arange(len(ids))
    starts = torch.where(F.pad(ends[:-1], (1, 0), value=True), place, 0)
    labels = window.clone()
    labels[1:][ends] = IGNORE
    return {"input_ids": ids, "labels": labels, "position_ids": place - torch.cummax(starts, 0).values}


def packed(rows: Any, seq_len: int, seed: int, pad_token_id: int, what: str) -> Dataset | None:
    """The `what` ("training", "eval") set `rows` packed for --packing, or None for no set; windows that keep
    their documents apart already (`documents_apart`) as they are. A stream is refused: packing plans bins over
    every row. `pad_token_id` (-1: the rows' own `pad_token_id`, else 0) fills each bin's tail."""
    if rows is None or getattr(rows, "documents_apart", False):
        return rows
    if isinstance(rows, IterableDataset):
        raise UsageError(f"--packing plans its bins over every row, and the {what} set is a stream (an "
                         "IterableDataset): give a map-style dataset (with __len__), or drop --packing")
    plan_file = getattr(rows, "plan_file", None)
    pad_id = pad_token_id if pad_token_id >= 0 else getattr(rows, "pad_token_id", 0)
    return pack(rows, seq_len, seed, pad_id, what, plan_file(seq_len, seed) if plan_file is not None else None)


def pack(rows: Dataset, seq_len: int, seed: int, pad_id: int, what: str,
         cache: Path | None = None) -> PackedRows:
    """`rows` packed into bins of `seq_len` tokens (`plan_bins`); the plan read from (or written to) `cache`,
    a file beside the tokenized rows, where one is given. `what` names the set in what is logged."""
    lengths = row_lengths(rows)
    if not lengths:
        raise UsageError(f"--packing: the {what} set has no rows")
    if min(lengths) < 1:
        raise UsageError(f"--packing: row {lengths.index(min(lengths))} of the {what} set has no tokens; drop it")
    longest = max(lengths)
    if longest > seq_len:
        raise UsageError(f"--packing: a row of the {what} set has {longest} tokens, more than --seq_len {seq_len}: "
                         "cut the rows to --seq_len first (a `hf:` dataset is cut as it is tokenized)")
    bins = _cached_plan(cache, lengths, seq_len, seed)
    tokens = sum(lengths)
    log.info("--packing: %d %s rows (%d tokens) in %d bins of %d: %.1f %% of the positions hold tokens (padded "
             "to the longest of 8 shuffled rows: %.1f %%)", len(lengths), what, tokens, len(bins), seq_len,
             100.0 * tokens / (len(bins) * seq_len), 100.0 * padded_fill(lengths, 8, seed))
    return PackedRows(rows, bins, seq_len, pad_id)


def _cached_plan(cache: Path | None, lengths: list[int], seq_len: int, seed: int) -> list[list[int]]:
    if cache is not None and cache.is_file():
        try:
            plan = json.loads(cache.read_text())
        except (OSError, ValueError):
            plan = {}  # planned again, and written whole
        if plan.get("rows") == len(lengths) and plan.get("tokens") == sum(lengths) and plan.get("lengths") == \
                _digest(lengths):
            return plan["bins"]
    bins = plan_bins(lengths, seq_len, seed)
    if cache is not None:  # every rank plans the same bins: whichever writes last writes the same file
        tmp = cache.with_name(f".{cache.name}.{uuid.uuid4().hex[:12]}.tmp")
        tmp.write_text(json.dumps({"rows": len(lengths), "tokens": sum(lengths), "lengths": _digest(lengths),
                                   "bins": bins}))
        tmp.replace(cache)
    return bins


def hint(rows: Any, batch_size: int, seed: int) -> None:
    """Without --packing: one line when about a third or more of a padded batch's positions would be padding, for
    rows whose lengths are known without reading them (tokenized hf: records). The batches of a shuffled epoch,
    estimated on one seeded shuffle."""
    own = getattr(rows, "row_lengths", None)
    if own is None or isinstance(rows, IterableDataset):
        return
    padding = 1.0 - padded_fill(own(), batch_size, seed)
    if padding > 1 / 3:
        log.info("about %.0f %% of the positions in a batch of %d rows are padding, which the model computes on "
                 "for nothing: --packing places the rows into bins of --seq_len instead (docs/tasks.md)",
                 100 * padding, batch_size)


def _digest(lengths: list[int]) -> str:
    """The rows' lengths in order, hashed: a plan is reused only for rows of these very lengths."""
    return hashlib.sha256(np.asarray(lengths, dtype=np.int64).tobytes()).hexdigest()[:16]


def padded_fill(lengths: Sequence[int], batch: int, seed: int) -> float:
    """The share of positions that hold tokens when the rows, in an order drawn from `seed` (as an epoch's), are
    padded to the longest of each batch of `batch` rows: what the padded loaders do."""
    lengths = list(lengths)
    np.random.default_rng(seed).shuffle(lengths)
    positions = sum(max(lengths[i:i + batch]) * len(lengths[i:i + batch]) for i in range(0, len(lengths), batch))
    return sum(lengths) / positions if positions else 1.0


# transformers' attention implementations that read a packed row's position_ids as documents (with no
# attention_mask): block-diagonal masks (sdpa, eager, flex), varlen lengths (FlashAttention).
DOCUMENT_AWARE_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


def check_model(module: Any, model_name: str) -> None:
    """Refuse, in one line, a model (`model_name`: as the run names it, "--model X") that could not keep a packed
    row's documents apart: its forward takes no `position_ids` (it would let them attend to each other, and
    number their positions as one), or a transformers attention implementation that ignores them."""
    try:
        takes = "position_ids" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        takes = False
    if not takes:
        raise UsageError(f"--packing: {model_name} takes no position_ids, so the documents of a packed row "
                         "would attend to each other; use a model whose forward takes them and keeps documents "
                         "apart (a transformers model, the built-in gpt), or drop --packing")
    kind = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if kind is not None and kind not in DOCUMENT_AWARE_ATTENTION:
        raise UsageError(f"--packing: {model_name} attends with {kind!r}, which does not keep a packed row's "
                         f"documents apart; load it with one of {', '.join(DOCUMENT_AWARE_ATTENTION)}, or drop "
                         "--packing")
