"""`make stress`: many short 2-process runs back to back, to catch the failures and hangs that one run in fifty
shows (a fork at the wrong instant, a teardown that never returns, a commit thread that dies unseen).

    python scripts/stress.py --runs 100            # what `make stress` does (N=100)
    python scripts/stress.py --runs 10 --seed 3    # another draw of kinds and kill points

Each run is one of the kinds below, drawn in turn; a third of them (of every kind alike) also SIGKILL one
worker at a random step and must finish through the launcher's restart (`--max_restarts 1`): the restart
resumes from the newest checkpoint exactly when the first attempt committed one (a kill before the first
commit starts fresh). The transformers Llama (weights on disk, made here from a config) is the final save's
kind: of its other runs, half SIGKILL a worker and half SIGSTOP one as the final save starts; a stopped
worker must be named by its peer's watchdog (phase final save) within its --hang_timeout_s, and the restart
writes the final weights.
Every run must exit 0 with its final weights written, within --timeout seconds (else: a hang, its process
tree is killed and the stacks are in the run's logs). Prints one line per run and a summary; exits 1 if any
run failed or hung. The run dirs of failed runs are kept under --work.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE = ["--model", "mlp", "--image_size", "8", "--width", "32", "--dataset_size", "512", "--eval_size", "61",
        "--batch_size", "16", "--lr", "0.1", "--log_interval", "2", "--no-progress", "--keep_last", "2",
        "--save_every_steps", "3", "--epochs", "2"]
HF_KIND = "fsdp, a transformers Llama loaded from its files, sync sharded saves, faults in the final save"
KINDS = {
    "ddp, persistent loader workers, async saves": ["--num_workers", "2", "--async_checkpoint"],
    "ddp, no loader workers, sync saves": ["--num_workers", "0"],
    "fsdp, persistent loader workers, async sharded saves": ["--strategy", "fsdp", "--num_workers", "2",
                                                             "--async_checkpoint"],
    "fsdp, sync sharded saves": ["--strategy", "fsdp", "--num_workers", "1"],
    "stream, loader workers forked per epoch, async saves": ["--dataset", "stream_plugins:image_stream",
                                                             "--num_workers", "2", "--max_steps", "24",
                                                             "--async_checkpoint", "--dataset_size", "256"],
    "fsdp, a GPT split by vocabulary rows, async sharded saves": [
        "--strategy", "fsdp", "--task", "language_model", "--model", "gpt", "--dataset", "pydoc", "--vocab_size",
        "256", "--seq_len", "32", "--width", "32", "--num_layers", "2", "--num_heads", "2", "--num_workers", "1",
        "--max_steps", "24", "--async_checkpoint"],
    HF_KIND: [
        "--strategy", "fsdp", "--task", "language_model", "--model", "hf:{llama}", "--dataset", "pydoc",
        "--seq_len", "32", "--num_workers", "0", "--max_steps", "12", "--hang_timeout_s", "10"],
}
STEPS = 2 * 512 // 32  # two epochs of 32-sample global batches; a kind with --max_steps runs that many


def make_llama(directory: Path) -> Path:
    """A small transformers Llama with weights (save_pretrained, several files and an index), for the bytes of
    the pydoc dataset (vocabulary 256)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory, max_shard_size="200KB")
    return directory


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "DDPTRAIN_FAULT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO / "tests")]))
    return env


def run_once(index: int, kind: str, kill: str | None, work: Path, timeout_s: float) -> tuple[str, str, float]:
    """('ok' | 'failed' | 'hang', detail, seconds) of one run."""
    run_dir = work / f"run-{index:03d}"
    flags = [flag.replace("{llama}", str(work / "llama")) for flag in KINDS[kind]]
    args = [sys.executable, "-m", "ddptrain", "train", *BASE, *flags, "--run_dir", str(run_dir),
            "--nproc", "2", "--max_restarts", "1"]
    env = environment()
    if kill:
        env["DDPTRAIN_FAULT"] = kill
    started = time.monotonic()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=REPO, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "hang", f"no exit after {timeout_s:.0f} s; logs in {run_dir / 'logs'}", time.monotonic() - started
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        last = [line for line in output.splitlines() if line.strip()][-1:] or ["(no output)"]
        return "failed", f"exit {proc.returncode}: {last[0]}", seconds
    if not (run_dir / "model.safetensors").is_file():
        return "failed", "exit 0 without model.safetensors", seconds
    if kill:
        problem = restart_problem((run_dir / "logs" / "rank-0.log").read_text())
        if "kind=stop" in kill and not problem:
            # The peer names it, and the phase: the stopped rank's, or (rank 0 stopped: the store it serves does not
            # answer) the one the naming rank waits in.
            logs = "".join(path.read_text() for path in (run_dir / "logs").glob("rank-*.log"))
            named = [line for line in logs.splitlines() if "stopped responding (" in line and "phase final save" in line]
            if not named:
                problem = "a worker stopped in the final save, and no watchdog named it in that phase"
        if problem:
            return "failed", problem, seconds
    shutil.rmtree(run_dir)
    return "ok", "", seconds


def restart_problem(log: str) -> str | None:
    """What is wrong with a killed run's restart, read from rank 0's log, or None. The workers must have been
    started again; the restart resumes from a checkpoint exactly when the first attempt committed one (a kill
    before the first commit, or during the first async commit, must start fresh)."""
    attempts = [[]]
    for line in log.splitlines():
        if " INFO run dir " in line and attempts[-1]:
            attempts.append([])
        attempts[-1].append(line)
    if len(attempts) < 2:
        return "a worker was killed, but the workers were not started again"
    committed = any("checkpoint committed:" in line for line in attempts[0])
    resumed = any("resuming from" in line for line in attempts[1])
    if committed != resumed:
        return ("the first attempt committed a checkpoint, but the restart did not resume from it" if committed
                else "the restart resumed although the first attempt committed no checkpoint")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds before a run counts as hung")
    parser.add_argument("--work", type=Path, default=None, help="where run dirs go (default: a temporary dir)")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="ddptrain-stress-"))
    work.mkdir(parents=True, exist_ok=True)
    draw = random.Random(args.seed)
    kinds = list(KINDS)
    tally: dict[str, int] = {"ok": 0, "failed": 0, "hang": 0}
    problems = []
    started = time.monotonic()
    if any(index % len(kinds) == kinds.index(HF_KIND) for index in range(args.runs)):
        make_llama(work / "llama")
    for index in range(args.runs):
        kind = kinds[index % len(kinds)]
        flags = KINDS[kind]
        steps = int(flags[flags.index("--max_steps") + 1]) if "--max_steps" in flags else STEPS
        kill = None
        if (index + index // len(kinds)) % 3 == 2:  # a third of the runs, each kind in turn (every round shifts)
            kill = f"rank={draw.randrange(2)},step={draw.randrange(2, steps)},kind=sigkill"
        elif kind == HF_KIND:  # the others: a worker killed or stopped as the final save starts
            fault = "sigkill" if (index // len(kinds)) % 2 else "stop"
            kill = f"rank={draw.randrange(2)},step={steps},kind={fault},at=final"
        outcome, detail, seconds = run_once(index, kind, kill, work, args.timeout)
        tally[outcome] += 1
        line = f"run {index + 1:3d}/{args.runs} {outcome:6s} {seconds:5.1f} s  {kind}{'; ' + kill if kill else ''}"
        print(line + (f"\n    {detail}" if detail else ""), flush=True)
        if outcome != "ok":
            problems.append(line)
    minutes = (time.monotonic() - started) / 60
    print(f"\nstress: {args.runs} runs in {minutes:.1f} min: {tally['ok']} ok, {tally['failed']} failed, "
          f"{tally['hang']} hung" + (f"; run dirs kept in {work}" if problems else ""))
    for line in problems:
        print(f"  {line}")
    if not problems and args.work is None:
        shutil.rmtree(work)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
