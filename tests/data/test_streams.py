"""Iterable datasets: every element once per epoch across ranks and loader workers, exact resume at the same
world size, and a clear refusal at another. Real processes, gloo on CPU."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from helpers import assert_bitwise_equal, assert_restarted, metrics, one_line_error, read_jsonl, train, weights

NUM = 203  # elements in the stream: not a multiple of the 4 readers or the batch
STREAM = ["--dataset", "stream_plugins:image_stream", "--dataset_size", str(NUM), "--eval_size", "37",
          "--batch_size", "8", "--num_workers", "2"]


def test_each_element_is_read_once_per_epoch_across_ranks_and_workers(tmp_path):
    # 2 ranks x 2 workers = 4 readers; reader s has the elements k = s mod 4 (50 or 51), of which 6 whole
    # batches of 8 (48) are trained on per epoch. 30 steps take each rank into its third epoch.
    train(tmp_path, *STREAM, "--max_steps", "30", "--record_sample_ids", nproc=2)
    by_epoch: dict[int, list[int]] = defaultdict(list)
    for rank in (0, 1):
        for row in read_jsonl(tmp_path / "samples" / f"rank-{rank}.jsonl"):
            by_epoch[row["epoch"]].extend(row["ids"])
    expected = {k for s in range(4) for k in [k for k in range(NUM) if k % 4 == s][:48]}
    for epoch in (0, 1):
        seen = by_epoch[epoch]
        assert len(seen) == len(set(seen)), f"an element was read twice in epoch {epoch}"
        assert set(seen) == expected, f"epoch {epoch} skipped elements or read the drop_last tail"
    assert metrics(tmp_path, "eval")[-1]["samples"] == 37, "eval reads every element once"


@pytest.mark.parametrize("save_every, fault, resumed_step", [
    ("5", "rank=1,step=8,kind=sigkill", 5),     # mid-epoch
    ("12", "rank=0,step=14,kind=sigkill", 12),  # resumed from the checkpoint right after each rank's last batch
], ids=["mid-epoch", "epoch-end"])
def test_a_killed_stream_run_resumes_bitwise(tmp_path, save_every, fault, resumed_step):
    job = [*STREAM, "--max_steps", "16", "--save_every_steps", save_every]
    train(tmp_path / "straight", *job, nproc=2)
    proc = train(tmp_path / "killed", *job, "--max_restarts", "1", nproc=2, env={"DDPTRAIN_FAULT": fault})
    assert_restarted(proc, tmp_path / "killed", from_step=resumed_step)
    assert_bitwise_equal(weights(tmp_path / "killed" / "model.safetensors"),
                         weights(tmp_path / "straight" / "model.safetensors"))
    losses = lambda d: [(r["step"], r["loss"]) for r in metrics(d, "train")]  # noqa: E731
    assert losses(tmp_path / "killed") == losses(tmp_path / "straight")


def test_resuming_a_stream_on_another_world_size_is_refused(tmp_path):
    train(tmp_path, *STREAM, "--max_steps", "4", nproc=2)
    line = one_line_error(train(tmp_path, *STREAM, "--max_steps", "8", check=False))
    assert "readers" in line and "--num_workers" in line and "same world size" in line


def test_the_same_number_of_readers_in_another_layout_is_refused(tmp_path):
    train(tmp_path, *STREAM, "--max_steps", "4")  # 1 process x 2 workers
    line = one_line_error(train(tmp_path, *STREAM, "--max_steps", "8", "--num_workers", "0", "--batch_size", "4",
                                nproc=2, check=False))
    assert "same world size and --num_workers" in line  # 2 processes x 1 reader: also 2 readers


class ShuffledIndices(torch.utils.data.IterableDataset):
    """0..size-1 in an order shuffled with torch's global RNG when iteration starts, as many streams do."""

    def __init__(self, size: int):
        self.size = size

    def __iter__(self):
        yield from torch.randperm(self.size).tolist()


def test_a_stream_that_shuffles_as_it_starts_is_read_alike_by_every_reader():
    from ddptrain.data.pipeline import Reading
    from ddptrain.data.streams import StreamShard, stream_loader

    for rank in (0, 1):  # 2 ranks x 2 loader workers: 4 readers, each must see the same shuffled order
        shard = StreamShard(ShuffledIndices(24), seed=3, rank=rank, world_size=2)
        loader = stream_loader(shard, Reading(workers=2, batch_size=3), torch.device("cpu"), drop_last=False,
                               seed=rank)
        read = [(k, int(x)) for ids, batch in loader for k, x in zip(ids, batch)]
        assert [k % 4 for k, _ in read if k % 4 not in (2 * rank, 2 * rank + 1)] == []
        if rank == 0:
            first = dict(read)
        else:
            both = {**first, **dict(read)}
    assert sorted(both) == list(range(24)) and sorted(both.values()) == list(range(24)), "elements read twice"


def test_a_stream_that_shards_itself_by_worker_is_still_read_whole(tmp_path):
    # PyTorch's docs teach a stream to split itself by get_worker_info(); ddptrain splits it by reader too.
    # Stacked, the two splits read half the data. The stream must see no worker info while ddptrain reads it.
    train(tmp_path, "--dataset", "stream_plugins:self_sharding", "--dataset_size", "40", "--batch_size", "4",
          "--num_workers", "2", "--max_steps", "10", "--record_sample_ids", "--eval_size", "0")
    ids = [k for row in read_jsonl(tmp_path / "samples" / "rank-0.jsonl") if row["epoch"] == 0 for k in row["ids"]]
    assert sorted(ids) == list(range(40))


def test_dropout_draws_the_same_with_and_without_loader_workers(tmp_path):
    # One reader either way. Without workers the stream is read in the training process, between the steps'
    # dropout draws: seeding an element must not leave the trainer's RNG in the element's state.
    job = [*STREAM, "--model", "fault_plugins:dropout_mlp", "--max_steps", "6", "--eval_size", "0"]
    train(tmp_path / "workers", *job, "--num_workers", "1")
    train(tmp_path / "inline", *job, "--num_workers", "0")
    assert_bitwise_equal(weights(tmp_path / "workers" / "model.safetensors"),
                         weights(tmp_path / "inline" / "model.safetensors"))
