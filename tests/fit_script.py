"""`ddptrain.fit` as a user's script runs it (tests/e2e/test_user_paths.py):

    python tests/fit_script.py RUN_DIR_OR_- MAX_STEPS [NPROC [MAX_RESTARTS]]

RUN_DIR `-` leaves the run dir to fit (runs/fit_script under the current directory). Prints the summary as
JSON on its last line; a failure prints `failed: <type>: <message>` and exits 1.
"""

from __future__ import annotations

import json
import sys

import ddptrain
from ddptrain.data.pipeline import SyntheticImages
from ddptrain.errors import TrainingError, UsageError


def main(run_dir: str, max_steps: int, nproc: int, max_restarts: int) -> None:
    config = ddptrain.TrainConfig(model="mlp", num_classes=4, in_channels=1, image_size=8, width=16, batch_size=16,
                                  max_steps=max_steps, save_every=0, save_every_steps=2, keep_last=0,
                                  num_workers=0, progress=False, nproc=nproc, max_restarts=max_restarts,
                                  run_dir="" if run_dir == "-" else run_dir)
    try:
        summary = ddptrain.fit(train_data=SyntheticImages(256, num_classes=4, channels=1, image_size=8, seed=3),
                               config=config)
    except (TrainingError, UsageError) as exc:
        print(f"failed: {type(exc).__name__}: {exc}")
        raise SystemExit(1)
    print(json.dumps({k: summary[k] for k in ("step", "updates")}))


if __name__ == "__main__":
    args = sys.argv[1:] + ["0", "0"]
    main(args[0], int(args[1]), int(args[2]), int(args[3]))
