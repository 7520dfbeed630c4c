"""Experiment trackers on rank 0, off the training thread: mirrors of metrics.jsonl (docs/trackers.md).

metrics.jsonl is the record; a tracker run is a mirror of it. `Trackers` hands every line that goes to
metrics.jsonl to each tracker's own thread, which talks to the tracker. A tracker that is slow, down or refusing
never holds up a step: its queue is bounded, its first failure is one warning, and `close` waits for it a
bounded time.

Nothing depends on a clean exit. Whenever a tracker's thread opens its run (each start of the job, and again
after a failure), it asks the tracker once which steps it has; before the attempt's first line it sends the
lines of metrics.jsonl the tracker lacks from the steps before that line (what a killed attempt never sent,
what a failure lost), then goes on live. The lines of an earlier attempt at later steps are not sent from the
file: this attempt trains those steps again and sends them live.

One run per run dir: RUN_DIR/trackers.json names each tracker's run and the byte where its part of
metrics.jsonl starts. It is written on the training thread before the attempt's first line, so a restart, a
resume or a rerun continues that run however early the first attempt died (a start over, --no-auto_resume,
begins a new run whose record starts at the end of the file). A step the tracker has is never sent again:
resume is bitwise, so its value is the one the tracker holds; a resume on another world size is sample-exact,
not bitwise, and there the tracker keeps the first value of such a step, metrics.jsonl both.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import math
import os
import queue
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

from ddptrain.config import ObserveSettings, parse_trackers
from ddptrain.errors import EXIT_FAILURE, EXIT_PREEMPTED, UsageError
from ddptrain.observe.metrics import read_metrics

log = logging.getLogger("ddptrain")

# tracker -> (the module it imports, the pip extra that installs it)
EXTRAS = {"mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}
STATE_FILE = "trackers.json"
SENT_SPLITS = ("train", "eval")  # lines a tracker receives (memory lines are in metrics.jsonl only)
SKIPPED_FIELDS = ("time", "step", "epoch", "split")
MLFLOW_BATCH_METRICS = 1000  # the most metrics MLflow takes in one log_batch
QUEUE_LINES = 10_000
RETRY_AFTER_S = 30.0  # after a failure, lines are counted as not sent for this long, then the run is reopened
CLOSE_WAIT_S = 30.0  # how long the end of a run waits for its trackers; 5 s for one that has failed


# MLflow's stores that are a database (its local default, sqlite:///mlflow.db, among them): the full mlflow
# package has what they need (SQLAlchemy), mlflow-skinny (ddptrain[mlflow]: a client) has not.
MLFLOW_DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def require_tracker(name: str, observe: ObserveSettings) -> None:
    """UsageError naming the pip extra unless tracker `name`'s package is installed; for MLflow, also unless its
    store can be opened by what is installed.

    Found, not imported: every process of a job runs this check (the launcher before it starts the workers), and
    only rank 0's tracker thread needs the package, whose import is slow."""
    if name not in EXTRAS:
        return
    module, extra = EXTRAS[name]
    if importlib.util.find_spec(module) is None:
        raise UsageError(f"--tracker {name} needs the {module} package: pip install 'ddptrain[{extra}]'")
    if name == "mlflow":
        uri = _mlflow_uri(observe)
        if _scheme(uri) in MLFLOW_DATABASE_SCHEMES and importlib.util.find_spec("sqlalchemy") is None:
            raise UsageError(
                f"--tracker mlflow: the store {uri} is a database, which needs the full mlflow package "
                "(ddptrain[mlflow] installs mlflow-skinny, a client): pip install mlflow, or pass "
                "--mlflow_tracking_uri http://HOST:PORT of a tracking server")


def _mlflow_uri(observe: ObserveSettings) -> str:
    """The MLflow store a run writes to: --mlflow_tracking_uri, else MLFLOW_TRACKING_URI, else MLflow's default."""
    uri = observe.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    import mlflow

    return mlflow.get_tracking_uri()


def _scheme(uri: str) -> str:
    return uri.split(":", 1)[0].split("+", 1)[0]


def _create_sqlite_store(uri: str) -> None:
    """Create the MLflow store `uri` whole where it is a SQLite file that does not exist yet; else nothing.

    MLflow creates a database store in place, by some seventy migrations that commit one at a time. Cut part-way
    (a run's end that stopped waiting for its tracker's thread, a kill) or run by two processes at once, they
    leave tables that the store's version stamp does not name, and every later open of the store fails on them
    ("table guardrails already exists"). Here MLflow creates it in a file of this process's own beside it, and
    the finished file is linked into place: the store is whole or absent. A link never replaces a file: of two
    processes creating the store at once, the first to finish places it and the other uses it. A process cut
    while it creates leaves its hidden .NAME.*.creating files, which can be deleted.
    """
    if _scheme(uri) != "sqlite":
        return
    from sqlalchemy.engine import make_url

    url = make_url(uri)
    if url.database in (None, "", ":memory:"):
        return
    path = Path(url.database).absolute()  # a relative path is MLflow's too: in the working directory
    if path.exists():
        return
    from mlflow.store.tracking import DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from sqlalchemy import event, pool

    building = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.creating")

    def unsynced(dbapi_connection: Any, record: Any) -> None:
        # Until it is linked into place the file is this process's alone, and a crash leaves it, never the store:
        # MLflow's commits (about a thousand) need not each wait for the disk; one fsync before the link does.
        if (isinstance(dbapi_connection, sqlite3.Connection)
                and dbapi_connection.execute("PRAGMA database_list").fetchone()[2] == str(building)):
            dbapi_connection.execute("PRAGMA synchronous = OFF")

    try:
        event.listen(pool.Pool, "connect", unsynced)
        try:
            # The artifact root MLflow's client gives a store it creates: its default experiment records it.
            store = SqlAlchemyStore(url.set(database=str(building)).render_as_string(hide_password=False),
                                    DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH)
            store.engine.dispose()  # no connection of this process keeps the file by its other name
        finally:
            event.remove(pool.Pool, "connect", unsynced)
        with open(building, "rb") as fh:
            os.fsync(fh.fileno())
        try:
            os.link(building, path)
        except FileExistsError:
            log.info("mlflow: the store %s was created by another process meanwhile; the run goes there", path)
        except OSError:  # a filesystem without hard links: a rename, which could replace a store made meanwhile
            if not path.exists():
                os.rename(building, path)
    finally:
        building.unlink(missing_ok=True)


def numeric_fields(record: dict[str, Any]) -> dict[str, float]:
    """The line's numbers a tracker plots, as '<split>/<field>' (lists, strings and non-finite values left out)."""
    split = record["split"]
    return {f"{split}/{key}": float(value) for key, value in record.items()
            if key not in SKIPPED_FIELDS and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


class Backend(Protocol):
    """One tracker, as a tracker thread drives it (every method runs on that thread)."""

    name: str

    def open(self) -> None:
        """Create or continue the run, and ask the tracker once which steps it has. Called again after a
        failure: it must not make a second run."""

    def lacks(self, record: dict[str, Any]) -> bool:
        """Whether the tracker lacks this line's step (of its split)."""

    def send(self, records: list[dict[str, Any]]) -> int:
        """Send the lines the tracker lacks, in order; how many were sent."""

    def close(self, status: str) -> None:
        """End the run: finished, failed or preempted."""


class _Worker:
    """One tracker's thread and queue."""

    def __init__(self, backend: Backend, record: Path, start_byte: int):
        self.backend, self.name = backend, backend.name
        self.record, self.start_byte = record, start_byte  # this tracker run's part of metrics.jsonl
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_LINES)
        self.sent = self.lost = 0
        self._failed = False
        self._retry_at = 0.0
        self._behind = True  # the run is to be (re)opened and caught up from metrics.jsonl before the next line
        self._earlier: list[dict[str, Any]] | None = None  # lines of metrics.jsonl the tracker lacks, once opened
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
        self._behind = True  # lines are lost from here on: the reopen after RETRY_AFTER_S catches them up
        if not self._failed:
            self._failed = True
            log.warning("tracker %s: %s; training goes on without it (metrics.jsonl has every line; the tracker "
                        "is sent the lines it lacks when it answers again)", self.name, what)

    def _run(self) -> None:
        self._behind = not self._call(self._open)
        while True:
            kind, payload = self._queue.get()
            if self._behind and time.monotonic() >= self._retry_at:
                self._behind = not self._call(self._open)
            if kind == "close":
                if not self._behind:
                    self._call(self._close, payload)
                return
            if not self._behind and self._call(self._send_live, payload):
                self.sent += 1
            else:
                self.lost += 1

    def _open(self) -> None:
        self.backend.open()
        earlier = read_metrics(self.record, self.start_byte) if self.record.exists() else []
        self._earlier = [r for r in earlier if r.get("split") in SENT_SPLITS and self.backend.lacks(r)]

    def _send_live(self, record: dict[str, Any]) -> None:
        if self._earlier is not None:
            # The first line since the run was opened: the lines before it that the tracker lacks go first. Lines
            # from its step on are this attempt's to send (it trains again what an earlier attempt did past its
            # checkpoint); at its own step only its own split's line is.
            split, step = record["split"], record["step"]
            self._catch_up([r for r in self._earlier if r["step"] < step or (r["step"] == step and r["split"] != split)])
        self.backend.send([record])

    def _catch_up(self, records: list[dict[str, Any]]) -> None:
        self._earlier = None
        if records:
            log.info("tracker %s: sent %d lines of metrics.jsonl it lacked", self.name, self.backend.send(records))

    def _close(self, status: str) -> None:
        if self._earlier is not None:  # not one line in this attempt: the record is all there is to mirror
            self._catch_up(self._earlier)
        self.backend.close(status)

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

    @classmethod
    def of_run(cls, observe: ObserveSettings, ctx: Any, run_dir: Path, version: str, params: dict[str, Any], *,
               resume: bool) -> "Trackers | None":
        """The trackers the [observe] section's --tracker names (rank 0's), sent the run's settings `params` and
        tagged with its world size, strategy, hosts and ddptrain's `version`; each continues the run of its own
        it started in this run dir where `resume` (--auto_resume). None when it names none."""
        names = parse_trackers(observe.tracker)
        if not names:
            return None
        tags = {"ddptrain.world_size": str(ctx.world_size), "ddptrain.strategy": params["strategy"],
                "ddptrain.hosts": ",".join(sorted(set(ctx.hosts))) or ctx.host, "ddptrain.version": version}
        return cls(names, run_dir, observe, params, tags, resume)

    def __init__(self, names: list[str], run_dir: Path, observe: ObserveSettings, params: dict[str, Any],
                 tags: dict[str, str], resume: bool):
        backends = {"mlflow": MlflowBackend, "wandb": WandbBackend}
        names = [name for name in names if name in backends]  # tensorboard is written by MetricSinks
        for name in names:
            # The package is imported here, before the first step (require_tracker only found it): on the
            # tracker's thread its import would hold the GIL for long stretches of the first steps. A broken
            # install is that thread's failure, which training outlives.
            with contextlib.suppress(ImportError):
                importlib.import_module(EXTRAS[name][0])
        record = run_dir / "metrics.jsonl"
        state = _read_state(run_dir)
        # Which run each tracker mirrors is settled here, on the training thread, before this attempt writes a
        # line: a kill at any later point finds it in trackers.json, and the run's record starts at that byte.
        known = {name: state[name] for name in names if resume and state.get(name)}
        start_byte = record.stat().st_size if record.exists() else 0
        new = {name: {backends[name].ID_KEY: uuid.uuid4().hex[:12], "start_byte": start_byte}
               for name in names if name not in known}
        if new:
            _write_state(run_dir, {**state, **new})
        self._workers = [_Worker(backends[name](run_dir, observe, params, tags, entry), record,
                                 entry.get("start_byte", 0)) for name, entry in {**known, **new}.items()]

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
                log.info("tracker %s: %d lines sent, %d not sent (metrics.jsonl has them; the next start sends "
                         "them)", worker.name, worker.sent, worker.lost)


def _read_state(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _write_state(run_dir: Path, state: dict[str, Any]) -> None:
    tmp = run_dir / f".{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, run_dir / STATE_FILE)


class MlflowBackend:
    """MLflow through its client: MLFLOW_TRACKING_URI (or --mlflow_tracking_uri), MLFLOW_EXPERIMENT_NAME (or
    --mlflow_experiment). Params: the resolved config, when the run is created. Metrics: each line's numbers at
    its step. Tags: world size, strategy, hosts. Status: FINISHED, FAILED, or KILLED with the tag
    ddptrain.status=preempted."""

    name = "mlflow"
    ID_KEY = "run_key"  # trackers.json: the tag that finds the run, set before the run exists
    STATUS = {"finished": "FINISHED", "failed": "FAILED", "preempted": "KILLED"}

    def __init__(self, run_dir: Path, observe: ObserveSettings, params: dict[str, Any], tags: dict[str, str],
                 entry: dict[str, Any]):
        self.run_dir, self.observe, self.params, self.tags, self.entry = run_dir, observe, params, tags, entry
        self.client: Any = None
        self.has: dict[str, set[int]] = {}  # split -> the steps the server has

    def open(self) -> None:
        # A tracker that does not answer costs this thread, not training: fail in seconds, not MLflow's minutes.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow.tracking import MlflowClient

        uri = _mlflow_uri(self.observe)
        _create_sqlite_store(uri)
        self.client = MlflowClient(tracking_uri=uri)
        if not self.entry.get("run_id"):
            self._find_or_create()
        else:
            self.client.update_run(self.entry["run_id"], status="RUNNING")
        self.has = self._steps_on_server()
        log.info("mlflow: run %s (the server has %d train and %d eval lines)", self.entry["run_id"],
                 len(self.has["train"]), len(self.has["eval"]))

    def _find_or_create(self) -> None:
        from mlflow.entities import Param, RunTag

        client, key = self.client, self.entry[self.ID_KEY]
        experiment_name = self.observe.mlflow_experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "ddptrain"
        experiment = client.get_experiment_by_name(experiment_name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(experiment_name)
        # An attempt killed between creating the run and saving its id left the run tagged with the key.
        found = client.search_runs([experiment_id], filter_string=f"tags.`ddptrain.run_key` = '{key}'",
                                   max_results=1)
        if found:
            run_id = found[0].info.run_id
            client.update_run(run_id, status="RUNNING")
        else:
            run_id = client.create_run(experiment_id, run_name=self.observe.tracker_run_name or self.run_dir.name,
                                       tags={"ddptrain.run_key": key, "ddptrain.run_dir": str(self.run_dir.resolve()),
                                             **self.tags}).info.run_id
        # Params again for a found run: it may have died between its batches (MLflow accepts an equal value).
        params = [Param(name, str(value)[:6000]) for name, value in sorted(self.params.items())]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(run_id, params=params[start:start + 100])
        client.log_batch(run_id, tags=[RunTag("ddptrain.status", "running")])
        self.entry.update(run_id=run_id, experiment_id=experiment_id, tracking_uri=client.tracking_uri)
        _write_state(self.run_dir, {**_read_state(self.run_dir), "mlflow": self.entry})
        log.info("mlflow: run %s in experiment %r", run_id, experiment_name)

    def _steps_on_server(self) -> dict[str, set[int]]:
        """split -> the steps of its lines the server has: the steps of every metric of the split (a line whose
        loss was not finite has none)."""
        run_id, has = self.entry["run_id"], {split: set() for split in SENT_SPLITS}
        for key in self.client.get_run(run_id).data.metrics:
            split = key.split("/", 1)[0]
            if split in has:
                has[split].update(m.step for m in self.client.get_metric_history(run_id, key))
        return has

    def lacks(self, record: dict[str, Any]) -> bool:
        return int(record["step"]) not in self.has[record["split"]]

    def send(self, records: list[dict[str, Any]]) -> int:
        from mlflow.entities import Metric

        batch: list[Metric] = []
        steps: list[tuple[str, int]] = []
        sent = 0
        for record in (r for r in records if self.lacks(r)):
            stamp = int(record.get("time", time.time()) * 1000)
            metrics = [Metric(key, value, stamp, int(record["step"])) for key, value in numeric_fields(record).items()]
            if len(batch) + len(metrics) > MLFLOW_BATCH_METRICS:
                sent += self._flush(batch, steps)
            batch += metrics
            steps.append((record["split"], int(record["step"])))
        return sent + self._flush(batch, steps)

    def _flush(self, batch: list, steps: list[tuple[str, int]]) -> int:
        if batch:
            self.client.log_batch(self.entry["run_id"], metrics=batch)
        for split, step in steps:
            self.has[split].add(step)
        sent = len(steps)
        batch.clear()
        steps.clear()
        return sent

    def close(self, status: str) -> None:
        from mlflow.entities import RunTag

        run_id = self.entry["run_id"]
        if status == "finished" and self.observe.tracker_log_model:
            for name in ("model.safetensors", "config.toml"):
                if (self.run_dir / name).is_file():
                    self.client.log_artifact(run_id, str(self.run_dir / name))
        self.client.log_batch(run_id, tags=[RunTag("ddptrain.status", status)])
        self.client.set_terminated(run_id, status=self.STATUS[status])


class WandbBackend:
    """Weights & Biases through `wandb.init`, configured as W&B configures itself (WANDB_MODE, WANDB_PROJECT,
    WANDB_ENTITY, WANDB_API_KEY; --wandb_project overrides the project). Its files go to RUN_DIR/wandb/; with
    WANDB_MODE=offline they are all there is until `wandb sync`. Config: the resolved config and the tags.
    History: each line's numbers at its step. Exit: 0 finished, 1 failed, 75 preempted (marked preempting);
    the summary's ddptrain/status says which.

    Online, W&B resumes the run itself (resume="allow", the same id): `run.step` is the step after the last it
    has. Offline, each attempt writes a folder of its own that starts empty, and is sent the whole record:
    W&B's files of earlier attempts are never read (their format is W&B's own, and a crash may have damaged
    them)."""

    name = "wandb"
    ID_KEY = "run_id"  # trackers.json: W&B takes the id a run is created with
    EXIT_CODES = {"finished": 0, "failed": EXIT_FAILURE, "preempted": EXIT_PREEMPTED}

    def __init__(self, run_dir: Path, observe: ObserveSettings, params: dict[str, Any], tags: dict[str, str],
                 entry: dict[str, Any]):
        self.run_dir, self.observe, self.params, self.tags = run_dir, observe, params, tags
        self.run_id = entry[self.ID_KEY]
        self.run: Any = None
        self.first_step = 0  # W&B has every step before it
        self.sent: dict[str, set[int]] = {split: set() for split in SENT_SPLITS}

    def open(self) -> None:
        import wandb

        if self.run is None:  # a reopen after a failure keeps the attempt's run (and its one folder)
            settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, save_code=False)
            self.run = wandb.init(
                project=self.observe.wandb_project or os.environ.get("WANDB_PROJECT") or "ddptrain", id=self.run_id,
                name=self.observe.tracker_run_name or self.run_dir.name, dir=str(self.run_dir), resume="allow",
                config={**self.params, **self.tags}, settings=settings, reinit="create_new")
            log.info("wandb: run %s in project %r (%s)", self.run_id, self.run.project,
                     "offline: RUN_DIR/wandb/" if self.run.offline else self.run.url)
        self.first_step = 0 if self.run.offline else self.run.step

    def lacks(self, record: dict[str, Any]) -> bool:
        step = int(record["step"])
        return step >= self.first_step and step not in self.sent[record["split"]]

    def send(self, records: list[dict[str, Any]]) -> int:
        sent = 0
        for record in (r for r in records if self.lacks(r)):
            self.run.log(numeric_fields(record), step=int(record["step"]))
            self.sent[record["split"]].add(int(record["step"]))
            sent += 1
        return sent

    def close(self, status: str) -> None:
        import wandb

        if status == "finished" and self.observe.tracker_log_model:
            artifact = wandb.Artifact(f"model-{self.run.id}", type="model")
            for name in ("model.safetensors", "config.toml"):
                if (self.run_dir / name).is_file():
                    artifact.add_file(str(self.run_dir / name))
            self.run.log_artifact(artifact)
        self.run.summary["ddptrain/status"] = status
        if status == "preempted":
            self.run.mark_preempting()
        self.run.finish(exit_code=self.EXIT_CODES[status])
