"""`ddptrain plan --tp N`: what a rank of a tensor-parallel group holds (the tp_plan's layers split, the rest whole),
the all-reduces a group runs per step, and --tp's refusals; all in this process (the model on the meta device)."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import cli_in_process, one_line_error

from ddptrain.config import TrainConfig
from ddptrain.tools import memplan, plan

MIB = 1 << 20


def _gpt(**changes) -> TrainConfig:
    values = dict(model="gpt", strategy="fsdp", task="language_model", vocab_size=256, seq_len=32, width=64,
                  num_layers=2, num_heads=4, batch_size=2, tp=2, vocab_parallel=False)  # units: the blocks, the root
    return TrainConfig(**{**values, **changes})


def _split_per_block(width: int) -> int:
    # qkv (colwise_fused3) and mlp.0 (colwise) split weight and bias; proj and mlp.2 (rowwise) their weight only.
    return (width * 3 * width + 3 * width) + width * width + (width * 4 * width + 4 * width) + 4 * width * width


def test_the_tp_plan_s_layers_split_and_a_rank_holds_half_of_them():
    shape = memplan.model_shape(_gpt())
    assert [u.tp_elements for u in shape.units] == [_split_per_block(64)] * 2 + [0]  # root: embeddings, norms, head
    half = shape.per_tp_rank(2)
    for whole, mine in zip(shape.units, half.units):
        assert mine.tp_elements * 2 == whole.tp_elements
        assert whole.elements - mine.elements == whole.tp_elements // 2  # the split part halves, the rest stays
    assert memplan.model_shape(_gpt(tp=1)).tp_elements == 0  # without --tp nothing is looked up


def test_fsdp_shards_a_group_s_share_over_the_data_parallel_ranks():
    cfg = _gpt(momentum=0.9, optimizer="sgd")
    shape = memplan.model_shape(cfg)
    tp2, tp1 = memplan.footprint(shape, cfg, 8), memplan.footprint(shape, cfg.replace(tp=1), 8)
    mine = shape.elements - shape.tp_elements // 2  # one rank of a group, before FSDP over dp = 8 / 2
    assert tp2.params == tp2.optimizer == -(-mine // 4) * 4
    assert tp1.params == -(-shape.elements // 8) * 4
    # ddp under --tp: each data-parallel rank holds its group's share whole.
    ddp = memplan.footprint(shape, cfg.replace(strategy="ddp"), 8)
    assert ddp.params == mine * 4


def test_between_split_layers_the_activations_are_a_rank_s_share_and_the_rest_whole():
    b, s, w = 2, 32, 64
    shape = memplan.model_shape(_gpt())
    last = shape.units[-2]  # a block (the first one also carries the step's largest tensor twice)
    # Whole on every rank: the block's input, norm1's output, the residual and norm2's output (and the norms'
    # small saved statistics); the rest (q, k, v, attention, the MLP's inner 4w) is computed from a split layer's
    # output.
    whole = last.activations - last.tp_activations
    assert 4 * b * s * w * 4 <= whole < 4 * b * s * w * 4 + b * s * w
    assert last.tp_activations >= (3 + 1 + 4 + 4) * b * s * w * 4
    assert shape.units[-1].tp_activations == 0
    half = shape.per_tp_rank(2).units[-2]
    assert half.activations == last.activations - last.tp_activations // 2


def test_a_rank_of_a_group_holds_less_than_a_data_parallel_rank_where_the_blocks_dominate():
    model = ["--model", "gpt", "--task", "language_model", "--vocab_size", "256", "--seq_len", "128", "--width", "256",
             "--num_layers", "4", "--num_heads", "4", "--batch_size", "8", "--strategy", "fsdp", "--gpus", "8"]
    peaks = {}
    for tp in (1, 2):
        proc = cli_in_process(["plan", *model, "--tp", str(tp)])
        assert proc.returncode == 0, proc.stderr
        row = next(cells for cells in map(str.split, proc.stdout.splitlines()) if cells[:1] == ["8"])
        peaks[tp] = float(row[8 if tp == 2 else 6])  # peak MiB/rank (tp 2 adds the column "dp x tp": "4 x 2")
    assert peaks[2] < 0.75 * peaks[1], peaks
    assert "4 x 2" in proc.stdout and "all-reduced per step" in proc.stdout


@pytest.mark.parametrize("change, factor", [({}, 1), ({"batch_size": 4}, 2), ({"seq_len": 64}, 2),
                                            ({"width": 128, "num_heads": 4}, 2), ({"num_layers": 3}, 1.5)])
def test_the_all_reduced_bytes_are_micro_batch_x_seq_x_width_x_blocks(change, factor):
    cfg = _gpt(**change)
    traffic = plan.tp_traffic(cfg, memplan.model_shape(cfg))
    # per block 2 in forward (proj, mlp.2), 2 in backward (qkv, mlp.0), each batch x seq x width at fp32
    assert traffic.sizes == (cfg.batch_size * cfg.seq_len * cfg.width * 4,) * (4 * cfg.num_layers)
    assert traffic.step_bytes == factor * 2 * 32 * 64 * 4 * 4 * 2
    assert traffic.by_layer == {(f"blocks.*.{layer}", direction): cfg.num_layers for layer, direction in
                                (("qkv", "backward"), ("proj", "forward"), ("mlp.0", "backward"), ("mlp.2", "forward"))}
    assert traffic.rank_bytes == traffic.step_bytes  # N = 2: a ring sends 2(N-1)/N = 1 of it


def test_precision_accumulation_and_recomputation_change_the_count_and_size():
    base = plan.tp_traffic(_gpt(), memplan.model_shape(_gpt()))
    amp = plan.tp_traffic(_gpt(use_amp=True), memplan.model_shape(_gpt(use_amp=True)))
    assert amp.step_bytes * 2 == base.step_bytes  # bf16 activations
    accum = _gpt(grad_accum_steps=3)
    assert plan.tp_traffic(accum, memplan.model_shape(accum)).step_bytes == 3 * base.step_bytes
    recompute = _gpt(activation_checkpointing=True)
    again = plan.tp_traffic(recompute, memplan.model_shape(recompute))
    assert len(again.sizes) == len(base.sizes) + 2 * 2  # each block's 2 forward all-reduces run again in backward
    # at 1 GB/s busbw and no latency, a step's all-reduces take their bytes over the ring's 2(N-1)/N
    assert base.step_s(1e9, 0.0) == pytest.approx(base.step_bytes / 1e9)


def test_cli_prints_the_group_s_all_reduces_and_the_bandwidth_they_need():
    model = ["--model", "gpt", "--task", "language_model", "--vocab_size", "256", "--seq_len", "32", "--width", "64",
             "--num_layers", "2", "--num_heads", "4", "--batch_size", "2", "--strategy", "fsdp", "--tp", "2"]
    proc = cli_in_process(["plan", *model, "--nproc", "4", "--step_ms", "10", "--busbw_gbps", "1"])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "per block 2 in forward (after blocks.*.proj, blocks.*.mlp.2) and 2 in backward" in " ".join(out.split())
    assert "micro-batch 2 x seq 32 x width 64 x 4 B" in " ".join(out.split())
    step = 8 * 2 * 32 * 64 * 4  # 8 all-reduces of 16 KiB
    assert f"all-reduced per step        {step / MIB:.1f} MiB" in out
    assert f"busbw it needs              {step / 1e-3 / 1e9:.3g} GB/s, to take <= 10% of a 10 ms step" in out
    assert "ms per step" in out and "efficiency" not in out  # no data-parallel table for a (dp, tp) mesh


@pytest.mark.parametrize("args, needle", [
    (["--model", "mlp", "--strategy", "fsdp", "--tp", "2"], "has no tensor-parallel plan"),
    (["--model", "gpt", "--num_heads", "3", "--strategy", "fsdp", "--tp", "2"], "--num_heads 3"),
    (["--model", "gpt", "--num_heads", "4", "--strategy", "fsdp", "--tp", "2", "--nproc", "3"], "--nproc 3"),
    (["--model", "gpt", "--num_heads", "4", "--strategy", "fsdp", "--tp", "2", "--gpus", "8,6,3"], "not 3:"),
    (["--model", "gpt", "--num_heads", "4", "--strategy", "fsdp", "--tp", "4", "--gpus_per_node", "6"],
     "the 6 ranks of a node"),
], ids=["no-plan", "heads", "nproc", "gpus", "per-node"])
def test_what_training_refuses_plan_refuses_in_one_line(args, needle):
    assert needle in one_line_error(cli_in_process(["plan", *args]))


def test_a_shape_without_split_layers_is_the_same_at_any_tp():
    shape = memplan.ModelShape((memplan.Unit("a", 1000, 1000, 400), memplan.Unit("root", 100, 100, 40)), True)
    assert shape.per_tp_rank(4) == shape
    split = memplan.ModelShape((dataclasses.replace(shape.units[0], tp_elements=800, tp_trainable=800,
                                                    tp_activations=300), shape.units[1]), True)
    mine = split.per_tp_rank(4).units[0]
    assert (mine.elements, mine.trainable, mine.activations) == (400, 400, 175)


def test_a_saved_doctor_tp_run_gives_the_group_s_bandwidth(tmp_path):
    """`doctor --tp 2`'s all-reduce within a group, not its sweep over the world, is the link the groups use."""
    from ddptrain.tools import doctor

    reports = [doctor.RankReport(rank=r, host="h", addr="10.0.0.1", interface="eth0", device="cpu", torch="2",
                                 python="3", ddptrain="0.1", code="abc", rendezvous_s=0.1, barrier_ms=0.1,
                                 run_dir_error="", run_dir_seen=[0, 1], all_reduce_ok=True) for r in range(2)]
    sweep = [{"bytes": 1024, "time_ms": 0.05, "algbw_gbps": 0.02, "busbw_gbps": 0.02},
             {"bytes": 64 * MIB, "time_ms": 20.0, "algbw_gbps": 3.4, "busbw_gbps": 3.4}]
    group = {"bytes": MIB, "time_ms": 0.01, "algbw_gbps": 100.0, "busbw_gbps": 100.0, "ok": True}
    saved = tmp_path / "doctor.txt"
    saved.write_text(doctor.render(reports, sweep, "nccl", "runs", [], doctor.render_tp(2, group, None)))
    model = ["--model", "gpt", "--task", "language_model", "--vocab_size", "256", "--seq_len", "32", "--width", "64",
             "--num_layers", "2", "--num_heads", "4", "--batch_size", "2", "--strategy", "fsdp", "--tp", "2"]
    proc = cli_in_process(["plan", *model, "--nproc", "2", "--doctor", str(saved)])
    assert proc.returncode == 0, proc.stderr
    assert "at busbw 100 GB/s" in proc.stdout, proc.stdout
