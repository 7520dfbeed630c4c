"""`ddptrain plan`: the scaling model's arithmetic against hand-computed values, its inputs, its CLI errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers import cli_in_process, one_line_error, run_cli

from ddptrain.config import TrainConfig, to_toml
from ddptrain.tools import doctor, memplan, plan

MIB = 1 << 20


def test_bucket_sizes_follow_ddp_small_first_bucket_then_cap():
    assert plan.bucket_sizes(100 * MIB, 25 * MIB) == [MIB, 25 * MIB, 25 * MIB, 25 * MIB, 24 * MIB]
    assert plan.bucket_sizes(MIB // 2, 25 * MIB) == [MIB // 2]
    assert plan.bucket_sizes(60 * MIB, 25 * MIB, first_bytes=25 * MIB) == [25 * MIB, 25 * MIB, 10 * MIB]


def test_ddp_buckets_hold_whole_tensors_in_backward_order():
    # A tensor larger than the open bucket's limit joins it: one 18 MB weight behind a small head = 1 bucket.
    assert plan.ddp_bucket_sizes([61_000, 6_000, 18_874_368], 25 * MIB) == [18_941_368]
    assert plan.ddp_bucket_sizes([MIB // 2, MIB // 2, 3 * MIB, 3 * MIB], 4 * MIB) == [MIB, 6 * MIB]
    assert plan.ddp_bucket_sizes([MIB] * 3, 25 * MIB, first_bytes=0) == [3 * MIB]


@pytest.mark.parametrize("model, cap_mb", [("mlp", 25.0), ("mini_resnet", 25.0), ("mini_resnet", 5.0),
                                           ("mini_resnet", 0.05)])
def test_ddp_buckets_match_what_ddp_all_reduces(tmp_path, model, cap_mb):
    """The model's buckets against a real DDP's (one gloo process; a communication hook sees each bucket)."""
    import os

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddptrain.loop.plugins import model_of

    cfg = TrainConfig(model=model, width=64, image_size=8)
    seen: list[int] = []

    def hook(state, bucket):
        seen.append(bucket.buffer().numel() * bucket.buffer().element_size())
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        module = model_of(cfg)
        ddp = DDP(module, bucket_cap_mb=cap_mb)
        ddp.register_comm_hook(None, hook)
        for _ in range(3):  # DDP rebuilds its buckets in the order gradients arrived after the first step
            seen.clear()
            ddp(torch.randn(4, 3, 8, 8)).sum().backward()
    finally:
        dist.destroy_process_group()
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)
    # Given a cap (as ddptrain always gives one), torch sizes DDP's first bucket like the others.
    cap = int(cap_mb * MIB)
    assert seen == plan.ddp_bucket_sizes(plan.tensor_bytes_in_backward_order(module), cap, first_bytes=cap)


def test_ring_all_reduce_time_by_hand():
    # 2(N-1) alpha + (S/B) 2(N-1)/N with S = 25 MiB, N = 8, B = 10 GB/s, alpha = 10 us:
    # 14 * 10e-6 + 26214400 / 1e10 * 14 / 8 = 0.00014 + 0.0045875200 = 0.00472752
    assert plan.ring_all_reduce_s(25 * MIB, 8, 10e9, 10e-6) == pytest.approx(0.00472752, rel=1e-12)
    assert plan.ring_all_reduce_s(25 * MIB, 1, 10e9, 10e-6) == 0.0


def _work(busbw: float) -> plan.Workload:
    # 100 ms step, 60 ms of it backward; 4 equal buckets of 25 MiB (first bucket as large as the cap).
    return plan.Workload(step_s=0.1, backward_fraction=0.6, grad_bytes=100 * MIB, busbw_bytes_per_s=busbw,
                         latency_s=10e-6, bucket_cap_bytes=25 * MIB, first_bucket_bytes=25 * MIB)


def test_predict_compute_bound_hides_all_but_the_last_bucket():
    # Buckets ready at 15, 30, 45, 60 ms; each takes 4.72752 ms, so each starts when ready and the last ends at
    # 64.72752 ms: 4.72752 ms exposed. Step 104.72752 ms; without overlap 100 + 4 * 4.72752 = 118.91008 ms.
    p = plan.predict(_work(10e9), 8)
    assert p.num_buckets == 4
    assert p.comm_s == pytest.approx(4 * 0.00472752, rel=1e-9)
    assert p.exposed_s == pytest.approx(0.00472752, rel=1e-9)
    assert p.step_s == pytest.approx(0.10472752, rel=1e-9)
    assert p.efficiency == pytest.approx(0.1 / 0.10472752, rel=1e-9)
    assert p.step_no_overlap_s == pytest.approx(0.11891008, rel=1e-9)


def test_predict_communication_bound_queues_the_buckets():
    # At 1 GB/s a bucket takes 14e-5 + 0.0262144 * 1.75 = 0.0460152 s > 15 ms between buckets: they queue
    # from the first (ready at 15 ms) and the last ends at 0.015 + 4 * 0.0460152 = 0.1990608 s.
    p = plan.predict(_work(1e9), 8)
    assert p.exposed_s == pytest.approx(0.1990608 - 0.06, rel=1e-9)
    assert p.step_s == pytest.approx(0.1 + 0.1990608 - 0.06, rel=1e-9)


def test_one_device_has_no_communication():
    p = plan.predict(_work(10e9), 1)
    assert (p.comm_s, p.step_s, p.efficiency) == (0.0, 0.1, 1.0)


def test_overlap_never_predicts_a_slower_step_than_no_overlap():
    # One bucket, ready at the end of backward: exposed = (backward + t) - backward, which rounds above t
    # for some inputs; a CI run of the bench's scaling row had efficiency_no_overlap 1 ulp above efficiency.
    for i in range(1, 500):
        work = plan.Workload(step_s=0.01 + i * 1e-5, backward_fraction=0.6, grad_bytes=1000 + 7 * i,
                             busbw_bytes_per_s=1e9, latency_s=1e-5)
        p = plan.predict(work, 2)
        assert p.num_buckets == 1 and p.exposed_s <= p.comm_s
        assert p.step_s <= p.step_no_overlap_s and p.efficiency_no_overlap <= p.efficiency


def test_efficiency_falls_with_scale():
    effs = [plan.predict(_work(10e9), n).efficiency for n in plan.DEFAULT_GPUS]
    assert effs == sorted(effs, reverse=True) and 0 < effs[-1] < effs[0] < 1


def _doctor_output(world: int) -> str:
    reports = [doctor.RankReport(rank=r, host="h", addr="10.0.0.1", interface="eth0", device="cpu", torch="2",
                                 python="3", ddptrain="0.1", code="abc", rendezvous_s=0.1, barrier_ms=0.1,
                                 run_dir_error="", run_dir_seen=list(range(world)), all_reduce_ok=True)
               for r in range(world)]
    sweep = [{"bytes": 1024, "time_ms": 0.05, "algbw_gbps": 0.02, "busbw_gbps": 0.02},
             {"bytes": 64 * MIB, "time_ms": 20.0, "algbw_gbps": 3.4, "busbw_gbps": 5.0}]
    return doctor.render(reports, sweep, "gloo", "runs", [])


def test_network_read_from_the_doctors_printed_sweep():
    busbw, alpha, world = plan.network_from_doctor(_doctor_output(4), "doctor.txt")
    assert world == 4
    assert busbw == pytest.approx(5.0e9)  # the largest size's busbw
    assert alpha == pytest.approx(0.05e-3 / 6)  # the smallest size's time over 2(N-1) = 6 hops


def _run_dir(tmp_path: Path, ranks: int) -> Path:
    cfg = TrainConfig(model="mlp", image_size=8, width=32)  # 192*32 + 32 + 32*10 + 10 = 6506 parameters
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(to_toml(cfg))
    lines = [{"time": 0, "step": 10 * (i + 1), "epoch": 0, "split": "train", "loss": 1.0, "step_time_s": t,
              "fwd_bwd_s": 0.09, "step_time_s_by_rank": [t] * ranks} for i, t in enumerate([0.5, 0.1, 0.12, 0.1])]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run


def test_compute_read_from_a_one_process_run(tmp_path):
    step_s, backward, grad_bytes = plan.compute_from_run(_run_dir(tmp_path, 1))
    assert step_s == pytest.approx(0.1)  # the median after the first (warm-up) line
    assert backward == pytest.approx(2 / 3 * 0.09 / 0.1)
    assert grad_bytes == 6506 * 4


def test_cli_prints_a_row_per_device_count_and_the_assumptions():
    proc = cli_in_process(["plan", "--step_ms", "100", "--grad_mib", "100", "--busbw_gbps", "10", "--gpus", "8,1024"])
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip().split(" ")[0] in ("8", "1024")]
    assert [r[0] for r in rows] == ["8", "1024"]
    assert "ring all-reduce" in proc.stdout and "efficiency" in proc.stdout


@pytest.mark.parametrize("args, needle", [
    ([], "--run_dir"),
    (["--step_ms", "100", "--grad_mib", "10"], "--busbw_gbps"),
    (["--step_ms", "100", "--grad_mib", "10", "--busbw_gbps", "-1"], "--busbw_gbps"),
    (["--step_ms", "100", "--grad_mib", "10", "--busbw_gbps", "1", "--gpus", "8,x"], "--gpus"),
    (["--step_ms", "100", "--grad_mib", "10", "--doctor", "/nonexistent/doctor.txt"], "--doctor"),
    (["--step_ms", "abc"], "--step_ms"),
], ids=["no-compute", "no-network", "negative-bandwidth", "bad-gpus", "missing-doctor-file", "not-a-number"])
def test_cli_usage_errors_are_one_line_exit_2(args, needle):
    assert needle in one_line_error(cli_in_process(["plan", *args]))


def test_cli_refuses_a_multi_process_run_dir(tmp_path):
    line = one_line_error(cli_in_process(["plan", "--run_dir", str(_run_dir(tmp_path, 2)), "--busbw_gbps", "1"]))
    assert "1 process" in line


def test_a_usage_error_ends_the_plan_process_with_exit_2_and_one_line():
    """The cases above run the CLI's `main` in this process; `python -m ddptrain plan` itself keeps the contract."""
    assert "--step_ms" in one_line_error(run_cli(["plan", "--step_ms", "abc"]))


def test_fsdp_moves_one_and_a_half_times_ddp_s_bytes_and_hides_all_but_the_ends():
    # 8 units of 12.5 MiB at N = 8, B = 10 GB/s, alpha = 10 us: one gather or reduce-scatter takes
    # 7e-5 + 13107200 / 1e10 * 7 / 8 = 0.0011469 s. Forward (30 ms) hides 7 gathers (8.03 ms), backward (60 ms)
    # 14 transfers (16.06 ms): exposed are 1 gather in forward, 1 gather + 1 reduce-scatter in backward.
    unit = 7e-5 + 13107200 / 1e10 * 7 / 8
    p = plan.predict(_work(10e9), 8)
    assert p.fsdp_comm_s == pytest.approx(24 * unit, rel=1e-9)
    assert p.fsdp_step_s == pytest.approx(0.1 + 3 * unit, rel=1e-9)
    # Bandwidth-bound (no latency), FSDP's bytes are 3 halves of DDP's 2 halves.
    free = plan.Workload(step_s=0.1, backward_fraction=0.6, grad_bytes=100 * MIB, busbw_bytes_per_s=1e9,
                         latency_s=0.0, bucket_cap_bytes=25 * MIB, first_bucket_bytes=25 * MIB)
    slow = plan.predict(free, 8)
    assert slow.fsdp_comm_s == pytest.approx(1.5 * slow.comm_s, rel=1e-9)
    # Communication-bound: the step is compute plus whatever of each pass's transfers exceeds it.
    half = 100 * MIB / 8 / 1e9 * 7 / 8
    assert slow.fsdp_step_s == pytest.approx(0.1 + half + max(0, 7 * half - 0.03) + 2 * half
                                             + max(0, 14 * half - 0.06), rel=1e-9)


def test_the_model_s_fsdp_units_come_from_its_blocks():
    from ddptrain.config import TrainConfig

    assert plan.fsdp_unit_count(TrainConfig(model="gpt", num_layers=4)) == 5
    assert plan.fsdp_unit_count(TrainConfig(model="mini_resnet")) == 7


# --- memory ------------------------------------------------------------------------------------------------

def _shape() -> memplan.ModelShape:
    # Two blocks and a root, in forward order; activations (fp32 bytes saved while each runs).
    return memplan.ModelShape((memplan.Unit("a", 1000, 1000, 400), memplan.Unit("b", 3000, 3000, 800),
                               memplan.Unit("root", 100, 100, 40)), activations_known=True)


def test_fsdp_memory_by_hand_peaks_in_the_backward_of_the_largest_unit():
    cfg = TrainConfig(strategy="fsdp", optimizer="sgd", momentum=0.9)
    f = memplan.footprint(_shape(), cfg, 4)
    # At rest each rank holds ceil(4100 / 4) = 1025 elements of parameters and momentum, fp32.
    assert (f.params, f.optimizer) == (4100, 4100)
    # Backward runs root, b, a. In b's: the root stays gathered (100 x 4), b is gathered twice (FSDP2's flat
    # buffer and the copy-out: 2 x 3000 x 4), its whole gradients and reduce-scatter input are there
    # (3000 x (4 + 4)) and a is gathered ahead (2 x 1000 x 4); the gradient shards of root and b exist
    # (25 + 750 elements); a's and b's activations are still saved (400 + 800).
    assert f.moment == "backward of b"
    assert (f.gathered, f.grads_at_peak, f.activations) == (400 + 24000 + 24000 + 8000, 4 * (25 + 750), 1200)
    assert f.grads == 4100 and f.held == 3 * 4100  # after backward: every unit's gradient shards
    assert f.device_peak == f.total == 4100 + 4100 + 3100 + 56400 + 1200
    offloaded = memplan.footprint(_shape(), cfg.replace(cpu_offload=True), 4)
    assert offloaded.device_peak == 56400 + 1200  # the state at rest is on the host
    assert offloaded.total == f.total
    # ddp: everything whole, DDP's buckets hold every gradient, the activations peak at the end of forward.
    ddp = memplan.footprint(_shape(), TrainConfig(strategy="ddp", momentum=0.9), 4)
    assert ddp.device_peak == 3 * 4100 * 4 + 1240


def test_a_unit_split_by_vocabulary_rows_is_never_gathered_nor_reduced():
    # b as a vocabulary matrix of 300 rows (parallel/vocab.py): in its backward only its rows' gradient, computed
    # and then averaged (2 x 750 x 4), beside the root and a gathered ahead; the peak moves to a's backward.
    shape = _shape()
    split = memplan.ModelShape((shape.units[0], dataclasses.replace(shape.units[1], vocabulary=300), shape.units[2]),
                               activations_known=True)
    f = memplan.footprint(split, TrainConfig(strategy="fsdp", momentum=0.0), 4)
    assert f.moment == "backward of a" and f.gathered == 400 + 8000 + 1000 * 8
    assert f.device_peak < memplan.footprint(shape, TrainConfig(strategy="fsdp", momentum=0.0), 4).device_peak
    # One rank has nothing to split with: b is gathered as before; a tied matrix (in the root unsplit) is the
    # root's again.
    assert memplan.footprint(split, TrainConfig(strategy="fsdp"), 1) == memplan.footprint(shape, TrainConfig(
        strategy="fsdp"), 1)
    tied = memplan.ModelShape((shape.units[0], dataclasses.replace(shape.units[1], vocabulary=300, in_root=True),
                               shape.units[2]), activations_known=True)
    in_root = memplan.ModelShape((shape.units[0], memplan.Unit("root", 3100, 3100, 840)), activations_known=True)
    assert memplan.footprint(tied, TrainConfig(strategy="fsdp"), 1) == memplan.footprint(in_root, TrainConfig(
        strategy="fsdp"), 1)
    # Between micro-steps FSDP2 holds the whole unsharded gradients of its units, not of the split rows.
    accumulating = memplan.footprint(split, TrainConfig(strategy="fsdp", momentum=0.0, grad_accum_steps=2), 4)
    assert accumulating.gathered == 400 + 8000 + 1000 * 8 + (1000 + 100) * 4


def test_bf16_weights_halve_the_state_and_the_gathered_units_but_not_an_fp32_reduction():
    full = memplan.footprint(_shape(), TrainConfig(strategy="fsdp", momentum=0.0), 4)
    half = memplan.footprint(_shape(), TrainConfig(strategy="fsdp", momentum=0.0, param_dtype="bf16"), 4)
    assert half.params * 2 == full.params and half.optimizer == full.optimizer == 0
    # b in bf16: 2 x 3000 x 2 gathered, gradients 3000 x 2, the fp32 reduce-scatter input 3000 x 4 and its
    # output 750 x 4, before the cast into the bf16 shard; a gathered ahead, 2 x 1000 x 2.
    assert half.gathered == 100 * 2 + 12000 + 3000 * (2 + 4) + 750 * 4 + 4000
    bf16_reduce = memplan.footprint(_shape(), TrainConfig(strategy="fsdp", momentum=0.0, param_dtype="bf16",
                                                          reduce_dtype="bf16"), 4)
    assert bf16_reduce.gathered == 100 * 2 + 12000 + 3000 * 4 + 4000


def test_without_resharding_every_unit_stays_gathered_and_accumulation_holds_whole_gradients():
    kept = memplan.footprint(_shape(), TrainConfig(strategy="fsdp", momentum=0.0, reshard_after_forward=False), 4)
    assert kept.moment == "backward of b"
    assert kept.gathered == 4100 * 4 + 3000 * 8  # everything gathered since forward, b's gradients
    accumulating = memplan.footprint(_shape(), TrainConfig(strategy="fsdp", momentum=0.0, grad_accum_steps=2), 4)
    assert accumulating.gathered == 400 + 24000 + 24000 + 8000 + 4100 * 4  # + the whole model's gradients


def test_the_meta_forward_counts_activations_by_unit_in_forward_order_without_parameters():
    cfg = TrainConfig(model="gpt", strategy="fsdp", task="language_model", vocab_size=4096, seq_len=32, width=64,
                      num_layers=3, num_heads=2, batch_size=4, vocab_parallel=False)
    shape = memplan.model_shape(cfg)
    assert [u.name for u in shape.units] == ["blocks.0", "blocks.1", "blocks.2", "root"]
    assert shape.elements == sum(p.numel() for p in __import__("ddptrain.loop.plugins", fromlist=["x"]).model_of(cfg)
                                 .parameters())
    blocks = [u.activations for u in shape.units[:-1]]
    assert len(set(blocks)) == 1 and blocks[0] > 0  # equal blocks save equal bytes
    # The root's (embeddings, head, loss) include the (4 x 32 x 4096) logits; the 1 MiB embedding is not counted.
    assert shape.units[-1].activations >= 4 * 32 * 4096 * 4
    double = memplan.model_shape(dataclasses.replace(cfg, batch_size=8))
    assert double.activations == pytest.approx(2 * shape.activations, rel=0.02)
    assert memplan.model_shape(cfg, activation_mib=3).activations == 3 * MIB


def test_cli_prints_the_memory_per_rank_alone_or_beside_the_speed():
    model = ["--model", "gpt", "--task", "language_model", "--vocab_size", "4096", "--seq_len", "32",
             "--width", "64", "--num_layers", "3", "--num_heads", "2", "--strategy", "fsdp"]
    proc = cli_in_process(["plan", *model, "--nproc", "4"])
    assert proc.returncode == 0, proc.stderr
    rows = _table_rows(proc.stdout)
    assert [r[0] for r in rows] == ["4"] and rows[0][-3] == "backward", proc.stdout
    assert "peak MiB/rank" in proc.stdout and "efficiency" not in proc.stdout
    both = cli_in_process(["plan", *model, "--step_ms", "100", "--grad_mib", "10", "--busbw_gbps", "10", "--gpus",
                           "8,64"])
    assert both.returncode == 0, both.stderr
    assert "peak MiB/rank" in both.stdout and "efficiency" in both.stdout
    assert [r[0] for r in _table_rows(both.stdout)] == ["8", "64", "8", "64"]  # memory, then speed


def _table_rows(text: str) -> list[list[str]]:
    return [cells for cells in map(str.split, text.splitlines()) if len(cells) > 2 and cells[0].isdigit()
            and cells[1].replace(".", "").isdigit()]


@pytest.mark.parametrize("args, needle", [(["--model", "nope"], "--model"),
                                          (["--model", "gpt", "--activation_mib", "-1"], "--activation_mib"),
                                          (["--model", "gpt", "--strategy", "zero"], "--strategy")],
                         ids=["unknown-model", "negative-activations", "bad-strategy"])
def test_memory_usage_errors_are_one_line_exit_2(args, needle):
    assert needle in one_line_error(cli_in_process(["plan", *args]))


def _measured_activation_peak(cfg: TrainConfig) -> int:
    """The most bytes a forward and backward of one micro-batch held above what was allocated before it, on the
    CPU, from torch's profiler (every allocation and free): the gradients exist already (a first step made them)."""
    from torch.profiler import ProfilerActivity, profile

    from ddptrain.loop.plugins import model_of, task_of
    from ddptrain.parallel.strategies import recompute_blocks

    torch.manual_seed(0)
    model, task = model_of(cfg), task_of(cfg)
    if cfg.activation_checkpointing:
        recompute_blocks(model, cfg.fsdp_blocks)
    batch = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1))
    task.loss(model, batch)[0].total.backward()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        task.loss(model, batch)[0].total.backward()
    held = peak = 0
    for event in sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("recompute", [False, True])
def test_the_planned_activations_are_within_10_percent_of_the_measured_peak_with_and_without_recomputation(recompute):
    """A GPT of 6 blocks under ddp: with --activation_checkpointing each block keeps only its input until its
    backward recomputes it, one block at a time, and the plan says so (without it, the plan would read 5x high)."""
    cfg = TrainConfig(model="gpt", strategy="ddp", task="language_model", vocab_size=512, seq_len=64, width=128,
                      num_layers=6, num_heads=2, batch_size=8, activation_checkpointing=recompute)
    shape = memplan.model_shape(cfg)
    assert [u.inputs for u in shape.units] == ([8 * 64 * 128 * 4] * 6 + [None] if recompute else [None])
    planned = memplan.footprint(shape, cfg, 1).activations
    measured = _measured_activation_peak(cfg)
    assert planned == pytest.approx(measured, rel=0.10), (planned, measured)


def test_recomputed_blocks_keep_their_inputs_and_the_backward_of_one_holds_its_activations_again():
    # _shape's blocks a and b recomputed, keeping 40 and 60 bytes of inputs; the root is not.
    units = _shape().units
    shape = memplan.ModelShape((dataclasses.replace(units[0], inputs=40), dataclasses.replace(units[1], inputs=60),
                                units[2]), activations_known=True)
    cfg = TrainConfig(strategy="fsdp", momentum=0.0, activation_checkpointing=True)
    f = memplan.footprint(shape, cfg, 4)
    assert f.moment == "backward of b" and f.activations == 40 + 60 + 800  # a's and b's inputs, b's own again
    ddp = memplan.footprint(shape, dataclasses.replace(cfg, strategy="ddp"), 4)
    assert ddp.moment == "backward of b" and ddp.activations == 40 + 60 + 800  # above 40 + 60 + 40 at the loss
