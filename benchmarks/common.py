"""Shared pieces of the benchmarks: launching workers, statistics, the results table."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ddptrain.parallel.procenv import fresh_env
from ddptrain.tools.tables import format_table

REPO = Path(__file__).resolve().parents[1]


class BenchError(RuntimeError):
    """A benchmark could not run (a worker failed): the message carries the tail of its log."""


def python() -> str:
    """The interpreter every launch of the harness runs: `PYTHON_EXEC` where set (torchrun's own override of its
    workers' interpreter, so a launch and the workers torchrun starts agree; tests/e2e/test_bench.py points it at a
    warm start of the test session's), else this one."""
    return os.environ.get("PYTHON_EXEC") or sys.executable


def bench_env(threads: int | None = None) -> dict[str, str]:
    """The environment of launched workers: no inherited launcher variables, the repo importable (PYTHONPATH
    unchanged where it has both already, so that a launch's environment is its parent's)."""
    env = fresh_env()
    paths = [str(REPO / "src"), str(REPO), *env.get("PYTHONPATH", "").split(os.pathsep)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(filter(None, paths)))
    env["PYTHONUNBUFFERED"] = "1"
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def default_threads(nproc: int) -> int:
    """What `ddptrain train --nproc N` gives each worker (launch.py): the cores shared out."""
    return max(1, (os.cpu_count() or 1) // nproc)


def run_logged(cmd: list[str], log: Path, env: dict[str, str], timeout_s: float) -> float:
    """Run `cmd` with output to `log`; return its wall seconds; BenchError with the log's tail on failure."""
    started = time.perf_counter()
    with open(log, "w") as fh:
        try:
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise BenchError(f"{' '.join(cmd[:6])} ... timed out after {timeout_s:.0f} s; log {log}") from None
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise BenchError(f"{' '.join(cmd[:8])} ... exited {proc.returncode}; log {log}:\n{tail}")
    return time.perf_counter() - started


def torchrun_cmd(nproc: int, module: str, *args: str) -> list[str]:
    return [python(), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", module, *args]


def ranks_cmd(nproc: int, script: Path) -> list[str]:
    """`python SCRIPT` on `nproc` processes, under torchrun; a single process is started alone (`ddptrain train`
    in it makes its own group of one: torchrun's agent would add a process and its start, nothing else)."""
    if nproc == 1:
        return [python(), str(script)]
    return [python(), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(script)]


@dataclass
class Launch:
    """Jobs for one torchrun launch of benchmarks.worker on `nproc` processes."""

    tag: str
    nproc: int
    jobs: list[dict[str, Any]]
    threads: int | None = None  # OMP threads per process; None: what `ddptrain train --nproc` gives
    timeout_s: float = 600

    @property
    def group(self) -> tuple[int, int]:
        return self.nproc, self.threads if self.threads is not None else default_threads(self.nproc)


def run_launch(launch: Launch, work: Path) -> list[dict[str, Any]]:
    """Run the launch's jobs; rank 0's results, one per job."""
    spec, out = work / f"{launch.tag}.jobs.json", work / f"{launch.tag}.out.json"
    spec.write_text(json.dumps(launch.jobs))
    run_logged(torchrun_cmd(launch.nproc, "benchmarks.worker", str(spec), str(out)), work / f"{launch.tag}.log",
               bench_env(launch.group[1]), launch.timeout_s)
    return json.loads(out.read_text())


def run_launches(launches: list[Launch], work: Path, grouped: bool) -> dict[str, list[dict[str, Any]]]:
    """Results by launch tag. `grouped`: launches of the same (nproc, threads) share one launch, in order —
    much faster (tests), but later jobs then run in processes that earlier jobs warmed up (and whose objects,
    the modules they imported, are frozen out of the later jobs' garbage collections)."""
    if not grouped:
        return {launch.tag: run_launch(launch, work) for launch in launches}
    results: dict[str, list[dict[str, Any]]] = {}
    groups: dict[tuple[int, int], list[Launch]] = {}
    for launch in launches:
        groups.setdefault(launch.group, []).append(launch)
    for (nproc, threads), members in groups.items():
        jobs = [{**job, "freeze": True} for m in members for job in m.jobs]
        merged = Launch(f"grouped-{nproc}x{threads}", nproc, jobs, threads, sum(m.timeout_s for m in members))
        outputs = iter(run_launch(merged, work))
        for m in members:
            results[m.tag] = [next(outputs) for _ in m.jobs]
    return results


@dataclass
class Plan:
    """A section: the worker launches it needs, and how to turn their results into table rows."""

    launches: list[Launch]
    finish: Callable[[dict[str, list[dict[str, Any]]]], list["Row"]]


# --- statistics ----------------------------------------------------------------------------------

def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def quartiles(values: list[float]) -> tuple[float, float]:
    """(q1, q3); with fewer than 4 values, (min, max)."""
    if len(values) < 4:
        return (min(values), max(values)) if values else (float("nan"), float("nan"))
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def paired_ratios(ours: list[float], theirs: list[float], skip: int) -> list[float]:
    """theirs_i / ours_i for each pair of adjacent blocks after `skip` warm-up pairs (> 1: ours is faster)."""
    return [t / o for o, t in list(zip(ours, theirs))[skip:]]


# --- the table -----------------------------------------------------------------------------------

@dataclass
class Row:
    """One line of the table: a figure, its target and verdict, and the note that explains it."""

    key: str
    benchmark: str
    ours: str
    theirs: str
    figure: str
    target: str
    passed: bool | None  # None: informational, no target
    note: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        return "-" if self.passed is None else ("PASS" if self.passed else "MISS")

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "benchmark": self.benchmark, "ddptrain": self.ours, "baseline": self.theirs,
                "figure": self.figure, "target": self.target, "verdict": self.verdict, "note": self.note,
                "data": self.data}


def render_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of `Row.to_json()` dicts, then the notes (every MISS has one)."""
    header = ["benchmark", "ddptrain", "baseline", "figure", "target", "verdict"]
    cells = [[r["benchmark"], r["ddptrain"], r["baseline"], r["figure"], r["target"], r["verdict"]] for r in rows]
    notes = [f"- {r['benchmark']}: {r['note']}" for r in rows if r["note"]]
    return format_table(header, cells, markdown=True) + ("\n\nNotes:\n" + "\n".join(notes) if notes else "")


def fmt_ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f} ms"


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]
