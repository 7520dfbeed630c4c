"""`ddptrain report RUN_DIR [--out DIR]`: pictures of a run and a short report.md, from its metrics.jsonl.

Works on a finished run and on one still being written (a torn last line is skipped). The pictures
need matplotlib (`pip install 'ddptrain[report]'`); they are drawn without pyplot, so no display,
backend choice or global state is involved.
"""

from __future__ import annotations

import argparse
import datetime
import math
import tomllib
from pathlib import Path
from typing import Any, Callable

from ddptrain.cliargs import ArgParser
from ddptrain.errors import UsageError
from ddptrain.observe.metrics import read_metrics
from ddptrain.tools.tables import format_table

STEP_PARTS = (("data_wait_s", "waiting for data"), ("fwd_bwd_s", "forward + backward"),
              ("optimizer_s", "optimizer"))
MAX_RANK_LINES = 16  # beyond this, per-rank step time is drawn as min / median / max


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = ArgParser(prog="ddptrain report", description="Draw PNG pictures and a report.md from a run dir.")
    parser.add_argument("run_dir", help="the run's directory (--run_dir of `ddptrain train`)")
    parser.add_argument("--out", default="", help="where to write report.md and the PNGs (default RUN_DIR/report)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir}: no such run dir; pass the --run_dir of a training run")
    metrics_path = run_dir / "metrics.jsonl"
    records = read_metrics(metrics_path) if metrics_path.is_file() else []
    if not records:
        raise UsageError(f"{run_dir}: no metrics yet ({metrics_path.name} is missing or empty); report a run "
                         "that has logged at least one step (see --log_interval)")
    figure_class = _figure_class()
    out = Path(args.out) if args.out else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    train = [r for r in records if r.get("split") == "train"]
    evals = [r for r in records if r.get("split") == "eval"]

    pictures = []
    for name, title, draw in PANELS:
        fig = figure_class(figsize=(7, 4), layout="constrained")
        if draw(fig.subplots(), train, evals):
            fig.savefig(out / f"{name}.png", dpi=110)
            pictures.append((name, title))
    overview = figure_class(figsize=(12, 8), layout="constrained")
    for ax, (_, title, draw) in zip(overview.subplots(2, 2).flat, PANELS[:4]):
        if not draw(ax, train, evals):
            ax.set_axis_off()
    overview.suptitle(f"ddptrain run {run_dir.resolve().name}")
    overview.savefig(out / "overview.png", dpi=90)

    (out / "report.md").write_text(render_markdown(run_dir, train, evals, pictures))
    print(f"report: {out / 'report.md'} with {len(pictures) + 1} pictures ({', '.join(n for n, _ in pictures)}, "
          "overview)")
    return 0


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError("ddptrain report needs matplotlib: pip install 'ddptrain[report]'") from None
    return Figure


# --- panels: each draws on one Axes and says whether it had anything to draw ---------------------

def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that carry a finite `key` (NaN/inf are written as null)."""
    pairs = [(r["step"], r[key]) for r in rows
             if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _finish(ax: Any, title: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()


def draw_loss(ax: Any, train: list[dict], evals: list[dict]) -> bool:
    drawn = False
    for rows, label, style in ((train, "train", "-"), (evals, "eval", "o-")):
        steps, values = _series(rows, "loss")
        if steps:
            ax.plot(steps, values, style, label=label, markersize=4)
            drawn = True
    _finish(ax, "Loss", "cross-entropy")
    return drawn


def draw_accuracy(ax: Any, train: list[dict], evals: list[dict]) -> bool:
    drawn = False
    for rows, label, style in ((train, "train", "-"), (evals, "eval", "o-")):
        steps, values = _series(rows, "accuracy")
        if steps:
            ax.plot(steps, [100 * v for v in values], style, label=label, markersize=4)
            drawn = True
    _finish(ax, "Accuracy", "% correct")
    return drawn


def draw_throughput(ax: Any, train: list[dict], evals: list[dict]) -> bool:
    steps, total = _series(train, "samples_per_sec")
    if not steps:
        return False
    ax.plot(steps, total, label="all ranks")
    per_steps, per_rank = _series(train, "samples_per_sec_per_rank")
    if per_steps and per_rank != total:
        ax.plot(per_steps, per_rank, label="per rank")
    _finish(ax, "Throughput", "samples / s")
    ax.set_ylim(bottom=0)
    return True


def draw_step_time(ax: Any, train: list[dict], evals: list[dict]) -> bool:
    rows = [r for r in train if all(isinstance(r.get(k), (int, float)) for k, _ in STEP_PARTS)
            and isinstance(r.get("step_time_s"), (int, float))]
    if not rows:
        return False
    steps = [r["step"] for r in rows]
    parts = [[1000 * r[key] for r in rows] for key, _ in STEP_PARTS]
    # The rest of the step: logging, checkpoints, between-step sync, Python overhead.
    parts.append([max(0.0, 1000 * r["step_time_s"] - sum(1000 * r[k] for k, _ in STEP_PARTS)) for r in rows])
    labels = [label for _, label in STEP_PARTS] + ["other"]
    ax.stackplot(steps, parts, labels=labels, alpha=0.85)
    _finish(ax, "Step time breakdown (mean per step, rank 0)", "ms")
    return True


def draw_ranks(ax: Any, train: list[dict], evals: list[dict]) -> bool:
    rows = [r for r in train if isinstance(r.get("step_time_s_by_rank"), list) and r["step_time_s_by_rank"]]
    if rows:
        steps = [r["step"] for r in rows]
        by_rank = [[1000 * t for t in r["step_time_s_by_rank"]] for r in rows]
        world = min(len(times) for times in by_rank)
        waits = [[1000 * w for w in r.get("data_wait_s_by_rank") or ()] for r in rows]
        if world <= MAX_RANK_LINES:
            for rank in range(world):
                line, = ax.plot(steps, [times[rank] for times in by_rank], label=f"rank {rank} step")
                if all(len(w) > rank for w in waits):
                    ax.plot(steps, [w[rank] for w in waits], "--", color=line.get_color(),
                            label=f"rank {rank} data wait")
        else:
            ordered = [sorted(times) for times in by_rank]
            ax.fill_between(steps, [t[0] for t in ordered], [t[-1] for t in ordered], alpha=0.3, label="min..max")
            ax.plot(steps, [t[len(t) // 2] for t in ordered], label="median")
        title = "Per rank: step time, data wait (dashed)" if any(waits) else "Step time per rank"
        _finish(ax, title, "ms per step")
        return True
    steps, skew = _series(train, "step_time_skew")
    if not steps:
        return False
    ax.plot(steps, skew, label="slowest / median")
    _finish(ax, "Step time skew across ranks", "ratio")
    return True


PANELS: list[tuple[str, str, Callable[[Any, list[dict], list[dict]], bool]]] = [
    ("loss", "Loss", draw_loss),
    ("accuracy", "Accuracy", draw_accuracy),
    ("throughput", "Throughput", draw_throughput),
    ("step_time", "Step time breakdown", draw_step_time),
    ("ranks", "Step time per rank", draw_ranks),
]


# --- report.md -----------------------------------------------------------------------------------

def _fmt(value: Any, digits: int = 4) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return "n/a" if value is None else str(value)


def _final_rows(train: list[dict], evals: list[dict]) -> list[tuple[str, str]]:
    rows = []
    if train:
        last = train[-1]
        rows.append((f"train loss (step {last['step']})", _fmt(last.get("loss"))))
    if evals:
        last = evals[-1]
        rows.append((f"eval loss (step {last['step']})", _fmt(last.get("loss"))))
        if isinstance(last.get("accuracy"), (int, float)):
            best = max((e for e in evals if isinstance(e.get("accuracy"), (int, float))),
                       key=lambda e: e["accuracy"])
            rows.append((f"eval accuracy (step {last['step']})", f"{100 * last['accuracy']:.2f} %"))
            rows.append(("best eval accuracy", f"{100 * best['accuracy']:.2f} % at step {best['step']}"))
    timed = [r for r in train if isinstance(r.get("samples_per_sec"), (int, float))]
    if timed:
        tail = timed[-max(1, len(timed) // 2):]  # the second half: past warm-up and first-step costs

        def mean(key: str) -> float:
            return sum(r.get(key) or 0.0 for r in tail) / len(tail)

        rows.append(("samples/s, all ranks (mean of the last half)", f"{mean('samples_per_sec'):,.1f}"))
        rows.append(("samples/s per rank", f"{mean('samples_per_sec_per_rank'):,.1f}"))
        rows.append(("step time: total / data wait / fwd+bwd / optimizer",
                     " / ".join(f"{1000 * mean(k):.1f} ms" for k in ("step_time_s", "data_wait_s", "fwd_bwd_s",
                                                                     "optimizer_s"))))
        last = timed[-1]
        if last.get("peak_mem_mb") is not None:
            rows.append(("peak memory (rank 0)", f"{last['peak_mem_mb']:,.0f} MiB"))
        if last.get("mfu") is not None:
            rows.append(("MFU", f"{100 * mean('mfu'):.2f} %"))
        if last.get("slowest_rank") is not None:
            rows.append(("slowest rank at the last log step",
                         f"rank {last['slowest_rank']} on {last.get('slowest_host', '?')}, "
                         f"{last.get('step_time_skew') or 1.0:.2f}x the median step time"))
    return rows


def _status(run_dir: Path, records: list[dict]) -> str:
    last = records[-1]
    when = datetime.datetime.fromtimestamp(last["time"]).isoformat(sep=" ", timespec="seconds")
    weights = run_dir / "model.safetensors"
    if weights.is_file() and weights.stat().st_mtime >= last["time"] - 1:
        return f"finished: final weights written after step {last['step']} (last metrics {when})"
    return f"running or stopped: last metrics at step {last['step']}, epoch {last['epoch']} ({when})"


def render_markdown(run_dir: Path, train: list[dict], evals: list[dict],
                    pictures: list[tuple[str, str]]) -> str:
    records = sorted(train + evals, key=lambda r: r["time"])
    lines = [f"# Run report: {run_dir.resolve().name}", "",
             f"- run dir: `{run_dir}`",
             f"- status: {_status(run_dir, records)}",
             f"- metrics: {len(train)} train and {len(evals)} eval lines in `metrics.jsonl`", "",
             "## Final metrics", "", format_table(["metric", "value"], _final_rows(train, evals), markdown=True)]
    lines += ["", "## Pictures", "", "![overview](overview.png)", ""]
    lines += [f"- [{title}]({name}.png)" for name, title in pictures]
    lines += ["", "## Config", ""]
    config_path = run_dir / "config.toml"
    try:
        text = config_path.read_text()
        tomllib.loads(text)  # only a well-formed resolved config goes into the report
        lines += [f"From `{config_path.name}`:", "", "```toml", text.rstrip(), "```"]
    except (OSError, tomllib.TOMLDecodeError):
        lines.append(f"No readable `{config_path.name}` in the run dir.")
    return "\n".join(lines) + "\n"
