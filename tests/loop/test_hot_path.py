"""Hot-path hygiene: nothing in a non-log step reads the device, and the settings that keep steps cheap hold.

The CPU tests count Python-level reads of tensor values (tests/hot_path_worker.py says which and why) in
real 2-process gloo training with gradient accumulation, and read the step settings off that run's objects. The GPU test is the stronger check: CUDA's own
sync debug mode raises on any synchronizing call, Python or C++, during non-log steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from fault_plugins import AugmentedImages
from helpers import REPO, TINY, cli_env

from ddptrain.checkpoints.shards import Staging
from ddptrain.config import resolve_config
from ddptrain.data.pipeline import Reading, SeededSamples, SyntheticImages, make_loader
from ddptrain.loop.trainer import Trainer, build_optimizer
from ddptrain.models import MiniResNet

# A conv net with BatchNorm (DDP broadcasts its buffers every forward) and accumulation (no_sync).
CONV = ["--model", "mini_resnet", "--width", "8", "--batch_size", "8", "--dataset_size", "4096",
        "--grad_accum_steps", "2", "--log_interval", "6", "--max_steps", "7", "--eval_size", "0", "--num_workers", "1"]

CONTROL_INTERVAL = 2  # votes in steps 2..5, so the count below tells a vote per step from one per 2 steps


@pytest.fixture(scope="module")
def worker_result(tmp_path_factory) -> dict:
    """tests/hot_path_worker.py's OUT.json from one real 2-process run with CONV."""
    tmp_path = tmp_path_factory.mktemp("hot_path")
    out = tmp_path / "reads.json"
    env = cli_env({"PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), str(REPO / "tests")])})
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(REPO / "tests" / "hot_path_worker.py"), str(out), *TINY, *CONV, "--run_dir",
                           str(tmp_path / "run"), "--control_interval", str(CONTROL_INTERVAL)], capture_output=True, text=True, env=env, cwd=REPO, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_non_log_steps_read_nothing_from_the_device(worker_result):
    result = worker_result
    assert result["steps"] == [2, 3, 4, 5], result["steps"]
    assert result["reads"] == [], "host reads in non-log steps:\n" + "\n".join(
        f"{r['method']} on {r['device']}:\n{r['where']}" for r in result["reads"])
    # The one expected read: the CPU flag tensor of the preemption/timed-save agreement, at the boundary after
    # each vote (cast after steps that are multiples of --control_interval), none at the others.
    assert result["control_reads"] == len([s for s in result["steps"] if (s - 1) % CONTROL_INTERVAL == 0])


@pytest.mark.gpu
def test_no_cuda_sync_in_non_log_steps(tmp_path):
    """torch.cuda.set_sync_debug_mode('error') turns any synchronizing CUDA call into an exception."""
    from benchmarks.probe import StepProbe
    from ddptrain.parallel.distributed import distributed

    cfg = resolve_config([*TINY, *CONV, "--backend", "nccl", "--run_dir", str(tmp_path)])
    with distributed("nccl", 60, tmp_path) as ctx:
        trainer = Trainer(cfg, ctx, tmp_path)
        checked = []

        def on_boundary(steps_done: int) -> None:
            strict = 1 <= steps_done < cfg.log_interval - 1
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()  # the previous step's work is done before the mode changes
            torch.cuda.set_sync_debug_mode("error" if strict else "default")
            if strict:
                checked.append(steps_done + 1)

        StepProbe(trainer, on_boundary)
        try:
            trainer.fit()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            trainer.close()
    assert checked == [2, 3, 4, 5]


def test_step_settings_that_avoid_known_traps_hold_on_the_live_objects(worker_result, tmp_path):
    """As the 2-process run's Trainer built them: a fused optimizer (one kernel; on-device inf skip), DDP
    gradients that alias its buckets, persistent loader workers (no re-fork per epoch), gradients set to None
    by each step's zero_grad (no memset), and every micro-batch moved to the device without blocking."""
    cfg = resolve_config([*TINY, *CONV, "--run_dir", str(tmp_path)])
    assert worker_result["settings"] == {
        "fused": True, "optimizer": "SGD", "gradient_as_bucket_view": True, "static_graph": False,
        "bucket_bytes_cap": int(cfg.bucket_cap_mb * 2**20), "num_workers": 1, "persistent_workers": True,
        "pin_memory": False, "prefetch_factor": 4}  # no pinning on CPU
    num_params = len(list(MiniResNet(width=8).parameters()))
    # Step 1 starts without gradients; every later step finds the previous step's and drops them all, and so
    # does the end of training, before the final eval, save and export (the last step's are spent).
    assert worker_result["zero_grads"] == [[0, 0]] + [[num_params, 0]] * 7, worker_result["zero_grads"]
    # Steps 2-5, 2 micro-batches each: inputs and targets.
    assert worker_result["non_blocking"] == [True] * (4 * 2 * 2), worker_result["non_blocking"]


def test_optimizers_are_fused_and_loaders_pin_memory_for_cuda_only(tmp_path):
    cfg = resolve_config([*TINY, "--run_dir", str(tmp_path)], validate=False)
    params = [torch.nn.Parameter(torch.zeros(3))]
    for optimizer in ("sgd", "adamw"):
        cfg.optimizer = optimizer
        assert build_optimizer(cfg, params, 0.1).defaults["fused"] is True
    data = SyntheticImages(8, 2, 1, 4, seed=0)
    assert make_loader(data, [[(0, 0)]], Reading(), torch.device("cuda"), seed=0).pin_memory is True
    assert make_loader(data, [[(0, 0)]], Reading(), torch.device("cpu"), seed=0).pin_memory is False


def test_batched_fetch_seeds_each_sample_and_restores_the_rngs():
    """SeededSamples.__getitems__ (one RNG save/restore per batch) equals per-sample reads exactly."""
    seeded = SeededSamples(AugmentedImages(64, 10, 3, 8, seed=1), seed=5)  # augmentation from the global RNG
    assert seeded.seeded
    keys = [(2, i) for i in range(0, 64, 5)]
    torch.manual_seed(9)
    untouched = torch.rand(3)
    torch.manual_seed(9)
    one_by_one = [seeded[key] for key in keys]
    after_one_by_one = torch.rand(3)
    assert torch.equal(after_one_by_one, untouched), "reading samples moved the training RNG"
    torch.manual_seed(9)
    batched = seeded.__getitems__(keys)
    assert torch.equal(torch.rand(3), after_one_by_one)
    for a, b in zip(one_by_one, batched):
        assert a[0] == b[0] and a[1][1] == b[1][1] and torch.equal(a[1][0], b[1][0])


def test_async_checkpoint_copy_reuses_its_staging_memory():
    staging = Staging()
    state = {"model": {"w": torch.randn(4, 3)}, "optim": {"state": {"w": {"momentum_buffer": torch.randn(4, 3)}}},
             "step": 3}
    first = staging.stage(state)
    assert torch.equal(first["model"]["w"], state["model"]["w"])
    assert first["model"]["w"].data_ptr() != state["model"]["w"].data_ptr()
    state["model"]["w"].add_(1.0)
    second = staging.stage(state)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()  # written in place
    assert torch.equal(second["model"]["w"], state["model"]["w"])
    state["model"]["w"] = torch.randn(5, 3)  # a changed shape gets fresh memory
    third = staging.stage(state)
    assert third["model"]["w"].shape == (5, 3) and torch.equal(third["model"]["w"], state["model"]["w"])
    assert third["step"] == 3


def test_async_staging_keeps_a_dtensors_layout_and_reuses_its_local_memory(tmp_path):
    """fsdp's state is DTensors: staged, each keeps its mesh, placements and global shape (what DCP plans the
    write by), with its local part copied into the memory the previous save used."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        live = DTensor.from_local(torch.randn(4, 3), mesh, [Shard(0)])
        staging = Staging()
        first = staging.stage({"w": live})["w"]
        assert isinstance(first, DTensor) and first.placements == live.placements and first.shape == live.shape
        assert first.device_mesh == mesh and torch.equal(first.to_local(), live.to_local())
        live.to_local().mul_(2.0)
        second = staging.stage({"w": live})["w"]
        assert second.to_local().data_ptr() == first.to_local().data_ptr()
        assert torch.equal(second.to_local(), live.to_local())
    finally:
        dist.destroy_process_group()