"""`make bench` = `python -m benchmarks.run`: every section, one table, and the JSON record.

    python -m benchmarks.run                  # full size: < 10 minutes on 2 idle cores
    python -m benchmarks.run --quick          # fewer rounds: a few minutes, noisier
    python -m benchmarks.run --tiny           # the harness at toy sizes (tests), side by side; numbers mean nothing
    python -m benchmarks.run --only overhead,data
    python -m benchmarks.run --only options --compile   # torch.compile too (minutes of compiling)

The table goes to stdout; progress to stderr; the JSON to benchmarks/results/<date>-<host>[-size].json
(or --out). Exit status 1 if a section could not run (its row says ERROR); a MISS is a result, not a failure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import socket
import sys
import tempfile
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, BenchError, Launch, Plan, Row, load_average, render_table, run_launches


def plans(names: list[str], size: str, work: Path, with_compile: bool) -> list[tuple[str, Plan]]:
    from benchmarks.big_model import big_model
    from benchmarks.lora import lora
    from benchmarks.options import options
    from benchmarks.packing import packing
    from benchmarks.sections import SECTIONS

    table = {**SECTIONS, "options": lambda size, work: options(size, work, with_compile), "big_model": big_model,
             "lora": lora, "packing": packing}
    return [(name, table[name](size, work)) for name in names]


def timed_launches(launches: list[Launch], work: Path, record: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """`run_launches(launches, work, grouped=True)`, its wall seconds in the record."""
    started = time.perf_counter()
    try:
        return run_launches(launches, work, grouped=True)
    finally:
        record["section_s"]["grouped workers"] = round(time.perf_counter() - started, 1)


def error_rows(name: str, exc: BaseException) -> tuple[list[Row], str]:
    message = str(exc) if isinstance(exc, BenchError) else traceback.format_exc()
    return [Row(name, name, "-", "-", "ERROR", "-", False, message.splitlines()[0])], message


ALL = ["overhead", "small_steps", "accumulation", "checkpoint", "data", "startup", "scaling", "sharding", "recompute", "options",
       "big_model", "lora", "packing"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", dest="size", const="quick", help="fewer rounds")
    size.add_argument("--tiny", action="store_const", dest="size", const="tiny", help="toy sizes, the sections side by "
                      "side: checks the harness")
    parser.add_argument("--only", default=",".join(ALL), help=f"comma-separated sections (default: {','.join(ALL)})")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/<date>-<host>[-size].json)")
    parser.add_argument("--work", help="scratch directory for run dirs and logs (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument("--compile", action="store_true", help="also measure --compile in the options section "
                        "(compiling adds minutes on 2 cores)")
    parser.add_argument("--grouped", action="store_true", help="run all sections' workers in one launch per "
                        "world size (faster, less isolated; implied by --tiny)")
    args = parser.parse_args(argv)
    size_name = args.size or "full"
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(ALL)}")

    import torch

    host = socket.gethostname()
    today = datetime.date.today().isoformat()
    out = Path(args.out) if args.out else (REPO / "benchmarks" / "results" /
                                           f"{today}-{host}{'' if size_name == 'full' else '-' + size_name}.json")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="ddptrain-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": host,
              "cpus": __import__("os").cpu_count(), "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, "python": platform.python_version(), "size": size_name,
              "load_avg_start": load_average(), "rows": [], "errors": {}, "section_s": {}}
    print(f"ddptrain bench ({size_name}) on {host}: {record['cpus']} cores, torch {torch.__version__}, "
          f"load average {record['load_avg_start']} (1/5/15 min); work dir {work}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    chosen = plans(names, size_name, work, args.compile)
    tiny = size_name == "tiny"
    grouped: Future | None = None  # the grouped launches' results by tag
    if args.grouped or tiny:  # every section's launches at once, one launch per world size
        print("running all sections' workers grouped by world size ...", file=sys.stderr, flush=True)
        pool = ThreadPoolExecutor(1)
        grouped = pool.submit(timed_launches, [launch for _, p in chosen for launch in p.launches], work, record)
        pool.shutdown(wait=not tiny)
    # At toy size the sections that start their own processes run meanwhile (toy numbers mean nothing; the harness
    # is checked sooner); the table keeps the sections' order.
    order = sorted(chosen, key=lambda item: bool(item[1].launches)) if tiny else chosen
    rows_of: dict[str, list[Row]] = {}
    for name, section in order:
        section_started = time.perf_counter()
        print(f"[{name}] running ...", file=sys.stderr, flush=True)
        try:
            if not section.launches:
                results = {}
            elif grouped is not None:
                results = grouped.result()  # (what stopped the grouped launches is raised in each section needing them)
            else:
                results = run_launches(section.launches, work, grouped=False)
            rows: list[Row] = section.finish(results)
        except Exception as exc:  # a broken section must not hide the others' figures
            rows, message = error_rows(name, exc)
            record["errors"][name] = message
            print(f"[{name}] ERROR:\n{message}", file=sys.stderr, flush=True)
        record["section_s"][name] = round(time.perf_counter() - section_started, 1)
        rows_of[name] = rows
        for r in rows:
            print(f"[{name}] {r.benchmark}: {r.figure} {r.verdict}", file=sys.stderr, flush=True)
    record["rows"] = [r.to_json() for name, _ in chosen for r in rows_of[name]]
    record["wall_s"] = round(time.perf_counter() - started, 1)
    record["load_avg_end"] = load_average()
    table = render_table(record["rows"])
    record["table"] = table
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"ddptrain bench ({size_name}), {record['date']}, {host} ({record['cpus']} cores), "
          f"torch {torch.__version__}; "
          f"load average {record['load_avg_start']} at start, {record['load_avg_end']} at end; "
          f"{record['wall_s']:.0f} s\n")
    print(table)
    print(f"\nJSON: {out}")
    if not args.keep and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if record["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
