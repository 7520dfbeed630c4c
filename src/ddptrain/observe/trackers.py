"""Experiment trackers on rank 0, off the training thread: one tracker run per run dir (docs/trackers.md).

`Trackers` takes every metrics line that goes to metrics.jsonl and hands it to each tracker's own thread,
which talks to the tracker. A tracker that is slow, down or refusing never holds up a step: its queue is
bounded (lines beyond are counted, not kept), its first failure is one warning, and `close` waits for it a
bounded time. metrics.jsonl stays the record.

One run per run dir: the tracker's run id is kept in RUN_DIR/trackers.json, and a restart, a resume or a
rerun after a preemption continues that run (a start over, --no-auto_resume, begins a new one). Resume is bitwise, so a step the restarted job trains again
has the value the tracker already holds: lines of steps the tracker has (asked of it when the run is
reopened) are not sent again. A resume on another world size is sample-exact, not bitwise: the tracker keeps
the first value of such a step, metrics.jsonl both.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import struct
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from ddptrain.errors import EXIT_FAILURE, EXIT_PREEMPTED, UsageError

log = logging.getLogger("ddptrain")

# tracker -> (the module it imports, the pip extra that installs it)
EXTRAS = {"mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}
STATE_FILE = "trackers.json"
SENT_SPLITS = ("train", "eval")  # lines a tracker receives (memory lines are in metrics.jsonl only)
SKIPPED_FIELDS = ("time", "step", "epoch", "split")
QUEUE_LINES = 10_000
RETRY_AFTER_S = 30.0  # after a failure, lines are counted as not sent for this long, then sending is tried again
CLOSE_WAIT_S = 30.0  # how long the end of a run waits for its trackers; 5 s for one that has failed


def require_tracker(name: str) -> None:
    """UsageError naming the pip extra unless tracker `name`'s package imports."""
    if name not in EXTRAS:
        return
    module, extra = EXTRAS[name]
    try:
        __import__(module)
    except ImportError:
        raise UsageError(f"--tracker {name} needs the {module} package: pip install 'ddptrain[{extra}]'") from None


def numeric_fields(record: dict[str, Any]) -> dict[str, float]:
    """The line's numbers a tracker plots, as '<split>/<field>' (lists, strings and non-finite values left out)."""
    split = record["split"]
    return {f"{split}/{key}": float(value) for key, value in record.items()
            if key not in SKIPPED_FIELDS and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


class _Worker:
    """One tracker's thread and queue. The backend's methods run on this thread only."""

    def __init__(self, backend: Any):
        self.backend, self.name = backend, backend.name
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_LINES)
        self.sent = self.lost = 0
        self._failed = False
        self._retry_at = 0.0
        self._thread = threading.Thread(target=self._run, name=f"ddptrain-tracker-{self.name}", daemon=True)
        self._thread.start()

    def put(self, item: tuple) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.lost += 1
            self._failure(f"more than {QUEUE_LINES} lines waiting")

    def _failure(self, what: str) -> None:
        self._retry_at = time.monotonic() + RETRY_AFTER_S
        if not self._failed:
            self._failed = True
            log.warning("tracker %s: %s; training goes on without it (metrics.jsonl has every line; the lines "
                        "not sent are counted at the end)", self.name, what)

    def _run(self) -> None:
        opened = self._call(self.backend.open)
        while True:
            kind, payload = self._queue.get()
            if not opened and time.monotonic() >= self._retry_at:
                opened = self._call(self.backend.open)
            if kind == "close":
                if opened:
                    self._call(self.backend.close, payload)
                return
            if opened and time.monotonic() >= self._retry_at and self._call(self.backend.log, payload):
                self.sent += 1
            else:
                self.lost += 1

    def _call(self, fn: Any, *args: Any) -> bool:
        try:
            fn(*args)
            return True
        except Exception as exc:  # a tracker's failure is never training's
            self._failure(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
            return False

    def close(self, status: str, deadline: float) -> None:
        self._retry_at = 0.0  # the final status is worth one more try
        self.put(("close", status))
        if self._failed:
            deadline = min(deadline, time.monotonic() + 5.0)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self.lost += self._queue.qsize()
            self._failure("still busy at the end of the run")


class Trackers:
    """The run's trackers (rank 0). `log` takes a metrics line; `close(status)` ends their runs."""

    def __init__(self, names: list[str], run_dir: Path, cfg: Any, tags: dict[str, str]):
        self._workers: list[_Worker] = []
        backends = {"mlflow": MlflowBackend, "wandb": WandbBackend}
        for name in names:
            if name in backends:  # tensorboard is written by MetricSinks beside metrics.jsonl
                self._workers.append(_Worker(backends[name](run_dir, cfg, tags)))

    def __bool__(self) -> bool:
        return bool(self._workers)

    def log(self, record: dict[str, Any]) -> None:
        if record["split"] in SENT_SPLITS:
            for worker in self._workers:
                worker.put(("log", record))

    def close(self, status: str) -> None:
        """`status`: finished, failed or preempted. Waits at most CLOSE_WAIT_S for all trackers together."""
        deadline = time.monotonic() + CLOSE_WAIT_S
        for worker in self._workers:
            worker.close(status, deadline)
            if worker.lost:
                log.info("tracker %s: %d lines sent, %d not sent (metrics.jsonl has them)", worker.name, worker.sent,
                         worker.lost)


def _read_state(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _write_state(run_dir: Path, state: dict[str, Any]) -> None:
    tmp = run_dir / f".{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, run_dir / STATE_FILE)


def resume_from(run_dir: Path, tracker: str, cfg: Any) -> dict[str, Any] | None:
    """This run dir's tracker run to continue (its trackers.json entry), or None for a new one."""
    known = _read_state(run_dir).get(tracker)
    return known if known and cfg.auto_resume else None


class MlflowBackend:
    """MLflow through its client: MLFLOW_TRACKING_URI (or --mlflow_tracking_uri), MLFLOW_EXPERIMENT_NAME (or
    --mlflow_experiment). Params: the resolved config, when the run is created. Metrics: each line's numbers at
    its step. Tags: world size, strategy, hosts. Status: FINISHED, FAILED, or KILLED with the tag
    ddptrain.status=preempted."""

    name = "mlflow"
    STATUS = {"finished": "FINISHED", "failed": "FAILED", "preempted": "KILLED"}

    def __init__(self, run_dir: Path, cfg: Any, tags: dict[str, str]):
        self.run_dir, self.cfg, self.tags = run_dir, cfg, tags
        self.sent_upto: dict[str, int] = {}  # split -> the last step the server has

    def open(self) -> None:
        # A tracker that does not answer costs this thread, not training: fail in seconds, not MLflow's minutes.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        import mlflow
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        uri = self.cfg.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        self.client = client = MlflowClient(tracking_uri=uri)
        known = resume_from(self.run_dir, "mlflow", self.cfg)
        if known:  # a restart, resume or rerun of this run dir's job: its run
            self.run_id = known["run_id"]
            client.update_run(self.run_id, status="RUNNING")
            for split in SENT_SPLITS:
                history = client.get_metric_history(self.run_id, f"{split}/loss")
                self.sent_upto[split] = max((m.step for m in history), default=-1)
            log.info("mlflow: continuing run %s (the server has train steps up to %d)", self.run_id,
                     self.sent_upto["train"])
            return
        experiment_name = self.cfg.mlflow_experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "ddptrain"
        experiment = client.get_experiment_by_name(experiment_name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(experiment_name)
        run = client.create_run(experiment_id, run_name=self.cfg.tracker_run_name or self.run_dir.name,
                                tags={"ddptrain.run_dir": str(self.run_dir.resolve()), **self.tags})
        self.run_id = run.info.run_id
        _write_state(self.run_dir, {**_read_state(self.run_dir), "mlflow": {
            "tracking_uri": uri or mlflow.get_tracking_uri(),
            "experiment_id": experiment_id, "run_id": self.run_id}})
        params = [Param(key, str(value)[:6000]) for key, value in sorted(self.cfg.to_dict().items())]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(self.run_id, params=params[start:start + 100])
        client.log_batch(self.run_id, tags=[RunTag("ddptrain.status", "running")])
        log.info("mlflow: run %s in experiment %r", self.run_id, experiment_name)

    def log(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        split, step = record["split"], int(record["step"])
        if step <= self.sent_upto.get(split, -1):
            return  # a step trained again after a restart: the server has its (bitwise equal) value
        stamp = int(record.get("time", time.time()) * 1000)
        metrics = [Metric(key, value, stamp, step) for key, value in numeric_fields(record).items()]
        self.client.log_batch(self.run_id, metrics=metrics)
        self.sent_upto[split] = step

    def close(self, status: str) -> None:
        from mlflow.entities import RunTag

        if status == "finished" and self.cfg.tracker_log_model:
            for name in ("model.safetensors", "config.toml"):
                if (self.run_dir / name).is_file():
                    self.client.log_artifact(self.run_id, str(self.run_dir / name))
        self.client.log_batch(self.run_id, tags=[RunTag("ddptrain.status", status)])
        self.client.set_terminated(self.run_id, status=self.STATUS[status])


class WandbBackend:
    """Weights & Biases through `wandb.init`, configured as W&B configures itself (WANDB_MODE, WANDB_PROJECT,
    WANDB_ENTITY, WANDB_API_KEY; --wandb_project overrides the project). Its files go to RUN_DIR/wandb/; with
    WANDB_MODE=offline they are all there is until `wandb sync`. Config: the resolved config and the tags.
    History: each line's numbers at its step. Exit: 0 finished, 1 failed, 75 preempted (marked preempting);
    the summary's ddptrain/status says which."""

    name = "wandb"
    EXIT_CODES = {"finished": 0, "failed": EXIT_FAILURE, "preempted": EXIT_PREEMPTED}

    def __init__(self, run_dir: Path, cfg: Any, tags: dict[str, str]):
        self.run_dir, self.cfg, self.tags = run_dir, cfg, tags
        self.sent_upto: dict[str, int] = {}

    def open(self) -> None:
        import wandb

        known = resume_from(self.run_dir, "wandb", self.cfg)
        run_id = known["run_id"] if known else uuid.uuid4().hex[:12]
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, save_code=False)
        self.run = wandb.init(
            project=self.cfg.wandb_project or os.environ.get("WANDB_PROJECT") or "ddptrain", id=run_id,
            name=self.cfg.tracker_run_name or self.run_dir.name, dir=str(self.run_dir), resume="allow",
            config=None if known else {**self.cfg.to_dict(), **self.tags}, settings=settings, reinit="create_new")
        if not known:
            _write_state(self.run_dir, {**_read_state(self.run_dir), "wandb": {
                "run_id": run_id, "project": self.run.project, "mode": "offline" if self.run.offline else "online"}})
            log.info("wandb: run %s in project %r (%s)", run_id, self.run.project,
                     "offline: RUN_DIR/wandb/" if self.run.offline else self.run.url)
            return
        # The steps W&B has: the server's next step online; offline, this run dir's earlier offline runs.
        if self.run.offline:
            self.sent_upto = wandb_history_steps(self.run_dir, run_id, exclude=Path(self.run.dir).parent)
        else:
            self.sent_upto = dict.fromkeys(SENT_SPLITS, self.run.step - 1)
        log.info("wandb: continuing run %s (it has train steps up to %d)", run_id, self.sent_upto.get("train", -1))

    def log(self, record: dict[str, Any]) -> None:
        split, step = record["split"], int(record["step"])
        if step <= self.sent_upto.get(split, -1):
            return  # a step trained again after a restart: W&B has its (bitwise equal) value
        self.run.log(numeric_fields(record), step=step)
        self.sent_upto[split] = step

    def close(self, status: str) -> None:
        import wandb

        if status == "finished" and self.cfg.tracker_log_model:
            artifact = wandb.Artifact(f"model-{self.run.id}", type="model")
            for name in ("model.safetensors", "config.toml"):
                if (self.run_dir / name).is_file():
                    artifact.add_file(str(self.run_dir / name))
            self.run.log_artifact(artifact)
        self.run.summary["ddptrain/status"] = status
        if status == "preempted":
            self.run.mark_preempting()
        self.run.finish(exit_code=self.EXIT_CODES[status])


# W&B's run files (RUN_DIR/wandb/*-<id>/run-<id>.wandb) are a LevelDB-style log of protobuf records: a 7-byte
# file header, then 32 KiB blocks of chunks, each with a 7-byte header (crc32, length, type: full, first,
# middle, last); a block's tail shorter than a chunk header is zero padding.
_WANDB_HEADER, _WANDB_BLOCK, _CHUNK = b":W&B", 32 * 1024, struct.Struct("<IHB")


def wandb_records(path: Path):
    """The records of one W&B run file as `wandb_internal_pb2.Record`s, up to the last complete one."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if not data.startswith(_WANDB_HEADER):
        return
    pos, pending = 7, b""
    while pos + _CHUNK.size <= len(data):
        left = _WANDB_BLOCK - pos % _WANDB_BLOCK
        _, length, kind = _CHUNK.unpack_from(data, pos)
        if left < _CHUNK.size or (length == 0 and kind == 0):
            pos += left  # padding up to the next block
            continue
        chunk = data[pos + _CHUNK.size:pos + _CHUNK.size + length]
        if len(chunk) < length:
            return  # a record still being written
        pos += _CHUNK.size + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_run_files(run_dir: Path, run_id: str) -> list[Path]:
    """This run's W&B run files in RUN_DIR/wandb/, oldest first (one per attempt)."""
    return sorted(path for path in (run_dir / "wandb").glob(f"*-{run_id}/run-{run_id}.wandb")
                  if not path.parent.is_symlink())


def wandb_rows(path: Path) -> list[dict[str, Any]]:
    """The history rows of one W&B run file, values decoded."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in wandb_records(path) if record.WhichOneof("record_type") == "history"]


def wandb_history(run_dir: Path, run_id: str, exclude: Path | None = None) -> list[dict[str, Any]]:
    """Every history row of the run's files in RUN_DIR/wandb/ (all attempts, oldest first)."""
    return [row for path in wandb_run_files(run_dir, run_id) if path.parent != exclude for row in wandb_rows(path)]


def wandb_history_steps(run_dir: Path, run_id: str, exclude: Path | None = None) -> dict[str, int]:
    """split -> the last step of its lines in the run's local files."""
    upto: dict[str, int] = {}
    for row in wandb_history(run_dir, run_id, exclude):
        for split in SENT_SPLITS:
            if any(key.startswith(f"{split}/") for key in row):
                upto[split] = max(upto.get(split, -1), int(row["_step"]))
    return upto
