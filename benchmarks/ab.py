"""The small-steps row's fixed cost, two checkouts against each other in alternating launches.

    python -m benchmarks.ab OTHER_CHECKOUT [--pairs 5] [--blocks 20]

`git worktree add /tmp/before <rev>` makes OTHER_CHECKOUT. Each launch is the small-steps row's interleaved job
(`benchmarks.sections.small_steps`: ddptrain and the raw loop alternating 20-step blocks inside one launch)
run from one checkout's `benchmarks` and `src`; launches alternate between the two checkouts. Printed per
launch and as medians: the training thread's CPU per step outside the timed phases ("rest") on each side,
and their difference, ddptrain's fixed per-step cost. On a shared VM that figure moves with the machine's
state by more than a change to it; only launches made side by side compare.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import REPO

CHILD = """
import json, statistics, sys
from pathlib import Path
from benchmarks.common import Launch, run_launch
from benchmarks.sections import PHASES, SMALL_MLP, common_flags
work, blocks = Path(sys.argv[1]), int(sys.argv[2])
block = 20
launch = Launch("ab", 2, [{"name": "ab", "mode": "interleave", "block_steps": block, "blocks": blocks + 1,
                           "settle_s": 0.05, "argv": [*SMALL_MLP["full"], *common_flags(work, "ab"),
                                                      "--max_steps", str((blocks + 1) * block + 1)]}])
[res] = run_launch(launch, work)
rest = lambda b: 1000 * (b["total"] - sum(b.get(p, 0.0) for p in PHASES)) / block
ours = [rest(b) for b in res["phase_cpu_s"]["ours"][1:]]
theirs = [rest(b) for b in res["phase_cpu_s"]["theirs"][1:]]
print(json.dumps({"ours": statistics.median(ours), "theirs": statistics.median(theirs),
                  "fixed": statistics.median(a - b for a, b in zip(ours, theirs))}))
"""


def launch(checkout: Path, blocks: int) -> dict[str, float]:
    """One interleaved launch of the small-steps job from `checkout`; its medians in ms per step."""
    with tempfile.TemporaryDirectory(prefix="ddptrain-ab-") as work:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout / "src"), str(checkout)])}
        out = subprocess.run([sys.executable, "-c", CHILD, work, str(blocks)], cwd=checkout, env=env,
                             capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("other", type=Path, help="the other checkout (a git worktree of the revision to compare)")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=20, help="block pairs per launch")
    args = parser.parse_args(argv)
    sides = {"other": args.other.resolve(), "this": REPO}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for pair in range(args.pairs):
        for name, checkout in sides.items():
            got = launch(checkout, args.blocks)
            results[name].append(got)
            print(f"pair {pair + 1} {name:5s} rest {got['ours']:.3f} vs raw {got['theirs']:.3f}: "
                  f"fixed {got['fixed']:.3f} ms/step", flush=True)
    for name, runs in results.items():
        print(f"{name} ({sides[name]}): fixed cost median {statistics.median(r['fixed'] for r in runs):.3f} ms/step "
              f"(rest {statistics.median(r['ours'] for r in runs):.3f} against the raw loop's "
              f"{statistics.median(r['theirs'] for r in runs):.3f}), {len(runs)} launches")


if __name__ == "__main__":
    main()
