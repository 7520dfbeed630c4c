"""The benchmark harness (benchmarks/): every section runs at a toy size and reports what it should.

Correctness of the harness only: no figure here is a speed claim, and nothing asserts a timing. The real
numbers come from `make bench` (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import REPO, WARM_STARTS, cli_env
from zygote import Zygote

from benchmarks.common import Row, paired_ratios, render_table
from benchmarks.probe import CpuAccount, Interleave, PhaseClock, StepProbe

SECTION_KEYS = {"overhead", "overhead_observed", "overhead_tracked", "overhead_small", "overhead_lm", "accumulation", "checkpoint", "data_synthetic", "data_cifar",
                "overhead_small_launches", "overhead_tensors", "overhead_tensors_launches", "startup", "scaling_miniresnet", "scaling_mlp", "overhead_fsdp", "fsdp_vs_ddp", "fsdp_accumulation",
                "big_model", "big_model_lora", "big_model_plan", "big_model_lora_plan", "lora", "lora_memory", "packing"}


# What the harness's Llama launches (big_model, lora, packing) import besides torch: ~1.5 s of CPU each. Not MLflow
# (the tracked overhead row's): its import starts a native thread, which a process that forks must not have.
LLAMA_IMPORTS = ("transformers", "transformers.models.llama.modeling_llama", "transformers.tokenization_utils_fast")


@contextlib.contextmanager
def harness_python(directory: Path, preload: tuple[str, ...] = ()):
    """`run(ARGS, timeout)`: `python ARGS` in the harness's environment, as subprocess.run(..., capture_output=True,
    text=True) runs it; it and every launch the harness makes from it (benchmarks.common.python: `PYTHON_EXEC`,
    which torchrun's workers also start with) are forks of a zygote (tests/zygote.py) started with that
    environment and `preload`: real processes, none paying torch's import. Fresh interpreters under
    DDPTRAIN_TEST_COLD=1."""
    env = cli_env({"PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), str(REPO / "tests")])})
    if not WARM_STARTS:
        yield lambda args, timeout: subprocess.run([sys.executable, *args], capture_output=True, text=True,
                                                   env=env, cwd=REPO, timeout=timeout)
        return
    shim = directory / "python"
    env["PYTHON_EXEC"] = str(shim)  # in the zygote's environment too: it refuses launches whose PYTHON* differ
    warm = Zygote(env, REPO, preload)
    # torchrun starts `PYTHON_EXEC -u ...`: unbuffered is PYTHONUNBUFFERED=1 already, and the zygote takes
    # `-m MODULE`, `-c CODE` or a script.
    shim.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(REPO / 'tests')!r})\n"
                    "if sys.argv[1:2] == ['-u']:\n    del sys.argv[1]\n"
                    f"import zygote\nzygote.forward({warm.address!r}, [])\n")
    shim.chmod(0o755)
    try:
        yield lambda args, timeout: warm.run(args, env=env, cwd=REPO, timeout=timeout)
    finally:
        warm.close()


@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory) -> tuple[dict, str]:
    work = tmp_path_factory.mktemp("bench")
    out = work / "result.json"
    with harness_python(work, LLAMA_IMPORTS) as run:
        proc = run(["-m", "benchmarks.run", "--tiny", "--out", str(out), "--work", str(work / "scratch")], 1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


def rows_by_key(record: dict) -> dict[str, dict]:
    return {row["key"]: row for row in record["rows"]}


@pytest.mark.slow  # the harness at toy size: ~40 s alone on 2 cores (150 s in fresh interpreters), most in the fixture
def test_every_section_reports_a_row_with_a_verdict(tiny_bench):
    record, stdout = tiny_bench
    rows = rows_by_key(record)
    assert SECTION_KEYS <= set(rows), set(rows)
    assert any(key.startswith("option --") for key in rows)
    assert not record["errors"]
    table = {line.split("|")[1].strip(): line.split("|")[-2].strip() for line in stdout.splitlines()
             if line.startswith("| ") and line.count("|") > 6}
    for row in rows.values():
        assert row["figure"] != "ERROR"
        assert table.get(row["benchmark"]) == row["verdict"], "the printed table has every row, with its verdict"
    misses = [row for row in rows.values() if row["verdict"] == "MISS"]
    assert all("MISS" in row["note"] for row in misses), "a miss without its explanation"
    assert record["load_avg_start"] and record["cpus"]


def test_interleaved_comparisons_pair_every_block(tiny_bench):
    rows = rows_by_key(tiny_bench[0])
    for key in ("overhead", "overhead_observed", "overhead_tracked", "overhead_small", "overhead_lm"):
        data = rows[key]["data"]
        assert len(data["ours_s"]) == len(data["theirs_s"]) == len(data["ratios"]) + 1  # one warm-up pair
        assert all(t > 0 and math.isfinite(t) for t in data["ours_s"] + data["theirs_s"])
        assert data["calls_s"]["_between_steps"]["count"] > 0
        for side in ("ours", "theirs"):  # rank 0's CPU by kind of thread, per step of its timed blocks
            cpu = data["cpu_ms_per_step"][side]
            assert cpu["training thread"] > 0 and all(v >= 0 for v in cpu.values()), cpu
        assert "CPU per step on rank 0" in rows[key]["note"]
        for side in ("ours", "theirs"):  # the training thread's CPU by phase: each side's own calls
            phases = data["phase_cpu_ms_per_step"][side]
            assert phases["forward"] > 0 and phases["backward"] > 0 and phases["optimizer"] > 0, phases
            assert phases["total"] >= phases["forward"] + phases["backward"] + phases["optimizer"], phases
        # The guard's gradient norm is ddptrain's alone: timed on its side, absent from the raw loop's.
        phases = data["phase_cpu_ms_per_step"]
        assert phases["ours"]["gradient norm"] > 0 and phases["theirs"].get("gradient norm", 0.0) == 0.0, phases


def test_small_steps_are_also_compared_as_separate_launches(tiny_bench):
    for key in ("overhead_small_launches", "overhead_tensors_launches"):  # synthetic images; a TensorDataset
        row = rows_by_key(tiny_bench[0])[key]
        data = row["data"]
        assert len(data["ddptrain_step_s"]) == len(data["raw_step_s"]) == len(data["ratios"]) >= 1
        assert all(t > 0 and math.isfinite(t) for t in data["ddptrain_step_s"] + data["raw_step_s"])
        assert data["ratios"] == [t / o for o, t in zip(data["ddptrain_step_s"], data["raw_step_s"])]
        assert "the raw loop's step" in row["note"]


def test_accumulation_counts_gradient_communication_per_micro_step(tiny_bench):
    data = rows_by_key(tiny_bench[0])["accumulation"]["data"]
    assert data["ddptrain"]["micro_steps_with_comm"] == [3]  # no_sync: only the last of 4 micro-steps
    assert data["seed_way"]["micro_steps_with_comm"] == [0, 1, 2, 3]
    assert data["ddptrain"]["rounds_per_step"] == 1 and data["seed_way"]["rounds_per_step"] == 4


def test_checkpoint_alternates_sync_and_async_saves(tiny_bench):
    data = rows_by_key(tiny_bench[0])["checkpoint"]["data"]
    modes = [save["mode"] for save in data["saves"]]
    assert modes == ["sync", "async"] * (len(modes) // 2) and modes
    assert all(save["blocked_s"] > 0 for save in data["saves"])
    assert data["checkpoint_bytes"] > 0


def test_data_startup_and_scaling_figures_are_well_formed(tiny_bench):
    rows = rows_by_key(tiny_bench[0])
    for key in ("data_synthetic", "data_cifar"):
        assert all(0 <= f < 1 for f in rows[key]["data"]["fractions_by_rank"])
    assert all(t > 0 for t in rows["startup"]["data"]["ddptrain_s"] + rows["startup"]["data"]["torchrun_s"])
    for key in ("scaling_miniresnet", "scaling_mlp"):
        data = rows[key]["data"]
        assert data["efficiency"] > 0
        assert 0 < data["plan"]["efficiency_no_overlap"] <= data["plan"]["efficiency"] <= 1
        # The communication hook saw every gradient byte once per step, in the buckets the plan models.
        assert data["bytes_per_step"] == data["grad_bytes"] and data["buckets_per_step"] == data["plan"]["num_buckets"]
        assert data["measured_comm_s"] > 0 and all(t > 0 for t in data["step_s_2_no_comm"])
        assert data["agreement"] == pytest.approx(statistics.median(data["step_s_2"]) /
                                                  data["plan_2_process_compute"]["step_s"])


def test_language_model_row_runs_the_lm_task_on_both_sides(tiny_bench):
    row = rows_by_key(tiny_bench[0])["overhead_lm"]
    assert row["target"] == ">= 0.97" and "tokens/s" in row["ddptrain"] and "tokens/s" in row["baseline"]
    assert "next-token" in row["note"]


def test_raw_loop_losses_match_the_lm_task():
    from benchmarks.raw_loop import masked_token_loss_sum, next_token_loss
    from ddptrain.data.batch import collate
    from ddptrain.loop.tasks import LanguageModel
    from ddptrain.models import GPT

    torch.manual_seed(0)
    model, tokens = GPT(32, 8, 16, 1, 2), torch.randint(0, 32, (3, 9))
    total, count = LanguageModel().loss(model, tokens)[0]
    torch.testing.assert_close(next_token_loss(model, tokens), total / count)
    batch = collate([{"input_ids": tokens[0, :n], "labels": torch.cat([torch.full((2,), -100), tokens[0, 2:n]])}
                     for n in (5, 8)])
    total, count = LanguageModel().loss(model, batch)[0]
    assert int(count) == LanguageModel().count(batch) == 3 + 6  # the masked prompt and the padding do not count
    assert torch.equal(masked_token_loss_sum(model, batch), total)


# --- pieces, without processes -------------------------------------------------------------------------

def test_interleave_runs_the_other_side_every_k_steps_and_stops():
    ran = []
    interleave = Interleave(torch.device("cpu"), block_steps=2,
                            run_other=lambda n: ran.append(n) or 0.5, settle_s=0.0, max_blocks=3)
    trainer = StepsOfTwo()
    probe = StepProbe(trainer, on_boundary=interleave)
    batches = iter(range(20))
    for _ in range(10):
        trainer.train_step(batches)
        trainer.position.step += 1
    assert trainer.read == list(range(20)) and probe.taken == 20  # the same batches, in order
    assert len(interleave.ours) == 3 and interleave.theirs == [0.5] * 3 and ran == [2, 2, 2]


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat"),
                    reason="needs Linux's /proc/<pid>/task/<tid>/schedstat")
def test_cpu_account_charges_each_kind_of_thread_its_own_cpu():
    """A ddptrain-* helper thread and a child process burn CPU while the calling thread sleeps."""
    import threading
    import time

    def burn(seconds: float, clock=time.thread_time) -> None:
        start = clock()
        while clock() - start < seconds:
            pass

    account = CpuAccount()
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile time.process_time() < 0.4: pass\n"
                              "print('burnt', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        burnt, done = threading.Event(), threading.Event()
        helper = threading.Thread(target=lambda: (burn(0.3), burnt.set(), done.wait(60)), name="ddptrain-burner")
        before = account.snapshot()
        helper.start()
        # Both have burnt theirs (the child's includes its interpreter's start) however busy the machine is.
        assert child.stdout.readline() == "burnt\n" and burnt.wait(60)
        after = account.snapshot()
        done.set()
        helper.join()
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    spent = account.spent(before, after)
    assert 0.28 <= spent["ddptrain threads"] < 0.5, spent
    assert 0.2 <= spent["loader workers"] < 0.8, spent  # what the child ran after `before`
    assert spent["training thread"] < 0.1 and spent["torch threads"] < 0.1, spent


def test_phase_clock_times_each_phase_on_the_calling_thread_only():
    import threading
    import time

    def burn(seconds: float) -> None:
        start = time.thread_time()
        while time.thread_time() - start < seconds:
            pass

    holder = SimpleNamespace(work=burn, idle=time.sleep)
    clock = PhaseClock()
    clock.wrap(holder, "work", "work")
    clock.wrap(holder, "idle", "idle")
    before = clock.reading()
    holder.work(0.05)
    holder.idle(0.1)  # sleeping is no CPU
    helper = threading.Thread(target=burn, args=(0.05,))  # another thread's CPU is not this thread's
    helper.start()
    helper.join()
    after = clock.reading()
    assert 0.05 <= clock.spent["work"] < 0.08 and clock.spent["idle"] < 0.01, clock.spent
    assert 0.05 <= after["total"] - before["total"] < 0.08


class StepsOfTwo:
    """The slice of a Trainer that StepProbe touches: steps of two micro-batches."""

    def __init__(self):
        self.position = SimpleNamespace(step=0)
        self.read = []

    def train_step(self, batches):
        self.read += [next(batches), next(batches)]


def test_paired_ratios_skip_warmup_and_table_keeps_notes():
    assert paired_ratios([1.0, 2.0, 4.0], [1.0, 1.0, 2.0], skip=1) == [0.5, 0.5]
    table = render_table([Row("k", "bench", "a", "b", "0.5", ">= 1", False, "MISS: why").to_json()])
    assert "| bench" in table and "MISS" in table and "- bench: MISS: why" in table


def test_gpu_script_fails_loudly_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the real script")
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu.sh")], capture_output=True, text=True, cwd=REPO,
                          timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 2
    assert "CUDA" in proc.stderr and "Traceback" not in proc.stderr


def test_sharding_rows_compare_fsdp_with_a_hand_written_fsdp2_loop_and_with_ddp(tiny_bench):
    rows = rows_by_key(tiny_bench[0])
    overhead = rows["overhead_fsdp"]
    assert "raw FSDP2" in overhead["baseline"] and len(overhead["data"]["ratios"]) >= 2
    memory = rows["fsdp_vs_ddp"]["data"]
    for kind in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        # Two ranks: each holds about half (dim-0 shards; rounding puts at most one row more on rank 0).
        assert 0.45 * memory["ddp_memory"][kind] <= memory["fsdp_memory"][kind] <= 0.51 * memory["ddp_memory"][kind]
    accumulation = rows["fsdp_accumulation"]["data"]
    # Between micro-steps: the whole model's unsharded gradients, or with the flag about half (rank 0's shard).
    whole = memory["ddp_memory"]["grad_bytes"]
    assert accumulation["peak_grad_bytes_last"] == whole
    assert 0.45 * whole <= accumulation["peak_grad_bytes_every"] <= 0.51 * whole
    assert all(t > 0 for t in accumulation["a_s"] + accumulation["b_s"])
