"""A trainer's main module, run as `python -m loader_main OUT`: it imports loader_main_dep and makes two passes
over a DataLoader whose workers start as ddptrain starts them (`data.worker_context`). OUT gets the pids of
the workers that made the batches, one per line."""

from __future__ import annotations

import os
import sys

import loader_main_dep  # noqa: F401  (recorded at import)
import torch
from torch.utils.data import DataLoader, Dataset

from ddptrain.data.pipeline import worker_context, worker_init


class Pids(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(os.getpid())


def main(out: str) -> None:
    context = worker_context()
    pids = set()
    for _ in range(2):
        loader = DataLoader(Pids(), batch_size=1, num_workers=2, worker_init_fn=worker_init,
                            multiprocessing_context=context)
        pids.update(int(batch) for batch in loader)
    with open(out, "w") as fh:
        fh.write("".join(f"{pid}\n" for pid in sorted(pids)))


if __name__ == "__main__":
    main(sys.argv[1])
