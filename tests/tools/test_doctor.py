"""`ddptrain doctor`: healthy runs exit 0 with bandwidth figures; odd ranks are named and exit 1."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, cli_env, cli_in_process, one_line_error, run_cli

from ddptrain.errors import UsageError
from ddptrain.parallel.procenv import free_port
from ddptrain.tools import doctor

# Rank 1 as a node with an unshared disk and other code (tests/odd_node/sitecustomize.py does it).
ODD_RANK_1 = {"PYTHONPATH": os.pathsep.join(str(REPO / d) for d in ("src", "tests", "tests/odd_node")),
              "ODD_NODE_RANK": "1", "ODD_NODE_CODE_HASH": "0badc0de0bad"}
SIZES = ["1 KiB", "4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB", "4 MiB", "16 MiB", "64 MiB"]


def sweep_rows(output: str) -> dict[str, tuple[float, float, float]]:
    """size -> (time ms, algbw, busbw) from the printed sweep."""
    rows = re.findall(r"^(\d+ [KM]iB)\s+([\d.]+)\s+([\d.e+-]+)\s+([\d.e+-]+)$", output, re.M)
    return {size: (float(t), float(alg), float(bus)) for size, t, alg, bus in rows}


def test_two_local_processes_are_healthy_with_a_full_sweep(tmp_path):
    proc = run_cli(["doctor", "--nproc", "2", "--run_dir", str(tmp_path / "run"), "--iters", "2", "--tp", "2",
                    "--tp_mib", "1"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "healthy" in proc.stdout
    # --tp 2: the group of ranks 0 and 1 all-reduces 1 MiB (N = 2: busbw = algbw = 1 MiB / time)
    group = re.search(r"^  all-reduce of 1 MiB within each group: ([\d.]+) ms, busbw ([\d.e+-]+) GB/s", proc.stdout,
                      re.M)
    assert group, proc.stdout
    assert float(group.group(2)) == pytest.approx((1 << 20) / float(group.group(1)) / 1e6, rel=0.02)
    assert re.search(r"^0\s+\S+\s+127\.0\.0\.1\s+lo\s+cpu", proc.stdout, re.M), proc.stdout
    assert re.search(r"^1\s+\S+\s+127\.0\.0\.1\s+lo\s+cpu.*sees 2/2$", proc.stdout, re.M), proc.stdout
    rows = sweep_rows(proc.stdout)
    assert list(rows) == SIZES
    for millis, algbw, busbw in rows.values():
        assert millis > 0 and algbw > 0 and busbw == algbw  # N = 2: 2(N-1)/N = 1
    assert list((tmp_path / "run").iterdir()) == []  # the probe files are cleaned up


def test_unshared_run_dir_and_odd_code_are_reported(tmp_path):
    proc = run_cli(["doctor", "--nproc", "2", "--run_dir", str(tmp_path / "run"), "--max_mb", "1"],
                   env=ODD_RANK_1)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    problems = proc.stdout[proc.stdout.index("problems:"):]
    assert re.search(r"code hash differs: rank 1 on \S+ \(127\.0\.0\.1\) has 0badc0de0bad, the others [0-9a-f]{12}",
                     problems), problems
    assert "is not the same storage on every rank" in problems
    assert re.search(r"rank 1 on \S+ \(127\.0\.0\.1\): sees the files of rank 1\)", problems), problems
    assert list(sweep_rows(proc.stdout)) == SIZES[:6]  # the figures are still printed
    assert "training failed" not in proc.stderr


def test_nproc_called_from_python_without_the_command_line_s_entry_is_a_usage_error(tmp_path):
    """`--nproc` workers run the command line (`cli.main`, handed in by it: the launcher imports no CLI);
    `doctor.main` called without it says how to run it instead of starting workers that could not."""
    with pytest.raises(UsageError, match="ddptrain doctor --nproc N"):
        doctor.main(["--run_dir", str(tmp_path), "--nproc", "2"])


def test_single_process_runs_every_check_in_process(tmp_path, capsys):
    assert doctor.main(["--run_dir", str(tmp_path), "--max_mb", "0.01", "--iters", "1"]) == 0
    output = capsys.readouterr().out
    assert "1 rank(s)" in output and "healthy" in output
    assert list(sweep_rows(output)) == ["1 KiB", "4 KiB"]


def test_tp_states_what_the_config_s_all_reduces_need_and_a_world_it_cannot_group(tmp_path, capsys):
    """One rank in this process: --tp 2 has no group to time (a problem, exit 1), but the config's need is stated,
    as `ddptrain plan --tp 2` counts it: 2 blocks x 4 all-reduces of 2 x 32 x 64 x 4 B = 128 KiB a step."""
    from ddptrain.config import TrainConfig, to_toml

    job = tmp_path / "job.toml"
    job.write_text(to_toml(TrainConfig(model="gpt", strategy="fsdp", task="language_model", vocab_size=256,
                                       seq_len=32, width=64, num_layers=2, num_heads=4, batch_size=2)))
    code = doctor.main(["--run_dir", str(tmp_path / "run"), "--max_mb", "0.01", "--iters", "1", "--tp", "2",
                        "--config", str(job)])
    output = capsys.readouterr().out
    assert code == 1
    assert "the config needs per step: 8 all-reduces, 0.1 MiB, each rank sending 0.1 MiB" in output, output
    assert "--tp 2 does not divide the ranks of every node (world 1, 1 on this one)" in output


def test_the_tp_section_puts_the_measured_bandwidth_beside_the_need():
    from ddptrain.tools.plan import TensorParallelTraffic

    traffic = TensorParallelTraffic(tp=2, micro_steps=2, by_layer={("blocks.*.proj", "forward"): 2},
                                    sizes=(1 << 20,) * 2, element_bytes=2)
    group = {"bytes": 1 << 20, "time_ms": 1.0, "algbw_gbps": 1.0, "busbw_gbps": 1.0, "ok": True}
    text = doctor.render_tp(2, group, traffic)
    assert "all-reduce of 1 MiB within each group: 1.000 ms, busbw 1 GB/s" in text
    # 4 all-reduces of 1 MiB a step, each 2(N-1)/N * 1 MiB at 1 GB/s: 4 * 1.048576 ms
    assert "needs per step: 4 all-reduces, 4.0 MiB, each rank sending 4.0 MiB" in text
    assert "they take 4.19 ms a step" in text
    assert "--config TRAINING.toml" in doctor.render_tp(2, group, None)


def _report(rank: int, **changes) -> doctor.RankReport:
    fields = dict(rank=rank, host=f"h{rank // 2}", addr=f"10.0.0.{rank // 2 + 1}", interface="eth0", device="cpu",
                  torch="2.13", python="3.11", ddptrain="0.1.0", code="abc", rendezvous_s=0.1, barrier_ms=1.0,
                  run_dir_error="", run_dir_seen=[0, 1, 2, 3], all_reduce_ok=True)
    return doctor.RankReport(**{**fields, **changes})


def test_problems_name_the_odd_ranks_and_their_hosts():
    reports = [_report(0), _report(1), _report(2, torch="2.12"), _report(3, torch="2.12"),
               _report(4, run_dir_error="PermissionError: Permission denied", all_reduce_ok=False)]
    problems = doctor.find_problems(reports, "runs")
    assert problems[0] == "torch version differs: rank 2, 3 on h1 (10.0.0.2) has 2.12, the others 2.13"
    assert problems[1].startswith("all-reduce returned wrong sums on rank 4 on h2 (10.0.0.3)")
    assert problems[2].startswith("run dir runs is not writable by rank 4 on h2 (10.0.0.3) (PermissionError")
    assert "not the same storage" in problems[3]  # no rank saw rank 4's file
    assert doctor.find_problems([_report(r, run_dir_seen=[0, 1]) for r in (0, 1)], "runs") == []


def test_bus_bandwidth_is_the_ring_all_reduce_factor():
    assert doctor.bus_bandwidth(10.0, 1) == 0.0
    assert doctor.bus_bandwidth(10.0, 2) == 10.0
    assert doctor.bus_bandwidth(10.0, 4) == 15.0
    assert doctor.bus_bandwidth(8.0, 8) == 14.0


def test_code_hash_is_stable_and_short():
    assert doctor.code_hash() == doctor.code_hash()
    assert re.fullmatch(r"[0-9a-f]{12}", doctor.code_hash())


def test_code_hash_follows_the_package_sources_not_where_they_lie(tmp_path, monkeypatch):
    """Two copies of the package hash alike; a changed byte, an added or a renamed source does not."""
    package = Path(doctor.__file__).resolve().parent.parent
    copies = [shutil.copytree(package, tmp_path / where / "ddptrain") for where in ("a", "b")]

    def hash_of(copy: Path) -> str:
        monkeypatch.setattr(doctor, "__file__", str(copy / "tools" / "doctor.py"))
        return doctor.code_hash()

    original = hash_of(copies[0])
    assert hash_of(copies[1]) == original  # by relative path: the install location does not count
    (copies[1] / "observe" / "__pycache__").mkdir(exist_ok=True)
    (copies[1] / "observe" / "__pycache__" / "stray.pyc").write_bytes(b"not a source")
    assert hash_of(copies[1]) == original

    source = copies[1] / "observe" / "perf.py"
    text = source.read_bytes()
    source.write_bytes(text.replace(b"def ", b"def  ", 1))
    assert hash_of(copies[1]) != original
    source.write_bytes(text)
    assert hash_of(copies[1]) == original

    (copies[1] / "extra.py").write_text("")
    assert hash_of(copies[1]) != original
    (copies[1] / "extra.py").unlink()
    source.rename(copies[1] / "observe" / "perf2.py")
    assert hash_of(copies[1]) != original


@pytest.mark.parametrize("args, env, names", [
    (["--iters", "0"], {}, "--iters"),
    (["--bogus"], {}, "--bogus"),
    (["--tp", "0"], {}, "--tp"),
    (["--config", "job.toml"], {}, "pass --tp N"),
])
def test_usage_errors_are_one_line(args, env, names):
    assert names in one_line_error(cli_in_process(["doctor", *args], env=env))


def test_runs_under_srun_starting_the_tasks_directly(tmp_path):
    """srun without torchrun: each task has only SLURM's variables plus the exported MASTER_ADDR/PORT."""
    port = free_port()
    tasks = [subprocess.Popen([sys.executable, "-m", "ddptrain", "doctor", "--run_dir", str(tmp_path), "--max_mb",
                               "0.01", "--iters", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=cli_env({"SLURM_NTASKS": "2", "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task),
                                           "SLURM_NTASKS_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1",
                                           "MASTER_PORT": str(port)}))
             for task in (0, 1)]
    outputs = [task.communicate(timeout=120)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outputs
    assert "2 rank(s)" in outputs[0] and "healthy" in outputs[0], outputs[0]
