"""checkpoints.manager.CheckpointManager over a world of one, in this process: it saves the parts it is given
(`states`, each a `Stateful`) and loads them back, with its own bookkeeping (the step last saved, the position);
async saves, the schedule, a best request, changed settings and the fall-back from an unusable checkpoint.
Starts no process (`make test-fast`): the group is gloo on a HashStore. What needs real ranks (exact resume
across processes, another world size, kills) is in test_resume.py, test_fsdp.py and test_checkpoint_faults.py.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ddptrain.checkpoints.format import BEST, Position, committed_steps, manifest_step
from ddptrain.checkpoints.manager import CheckpointManager, RankStates
from ddptrain.config import TrainConfig
from ddptrain.errors import UsageError
from ddptrain.loop.checkpointed import LoopState, ModelState, RngState
from ddptrain.parallel.distributed import DistributedContext


@pytest.fixture
def ctx():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield DistributedContext(rank=0, local_rank=0, world_size=1, local_world_size=1, backend="gloo",
                                 device=torch.device("cpu"), host="here", hosts=["here"])
    finally:
        dist.destroy_process_group()


class Counter:
    """A part with state of both scopes, which records each call into `calls` (shared by the parts)."""

    def __init__(self, name: str, calls: list[str]):
        self.name, self.calls = name, calls
        self.total, self.mine = 0, 0

    def state_dict(self) -> dict[str, Any]:
        self.calls.append(f"save {self.name}")
        return {"shared": {f"{self.name}_total": self.total}, "rank": {f"{self.name}_mine": self.mine}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls.append(f"load {self.name}")
        self.total = state["shared"][f"{self.name}_total"]
        self.mine = state["ranks"].own[f"{self.name}_mine"]


class Run:
    """One process's run of a linear model, its parts and their manager: a fresh `Run` over the same directory is
    a restarted process."""

    def __init__(self, ctx: DistributedContext, directory: Path, config: dict[str, Any] | None = None,
                 tokenizer_digest: str | None = None, **settings: Any):
        torch.manual_seed(1)  # every process builds the same model; training makes them differ
        self.module = torch.nn.Linear(4, 3)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1, momentum=0.9)
        self.calls: list[str] = []
        parallel = SimpleNamespace(sharded=False, sync_buffers=lambda: self.calls.append("buffers agreed"))
        self.model = ModelState(self.module, self.optimizer, parallel, ctx, lambda: self.manager.group, "sgd",
                                "linear", 0)
        self.first, self.second = Counter("first", self.calls), Counter("second", self.calls)
        self.position = Position(step=0, epoch=0, cursor=0, global_batch_size=8, world_size=1)
        config = config or TrainConfig().to_dict()
        self.manager = CheckpointManager(
            TrainConfig(**{"save_every": 0, "keep_last": 0, **settings}).section("checkpoint"), ctx,
            {"model": self.model, "first": self.first, "second": self.second}, self.position, directory, 60.0,
            config=config, tokenizer_digest=tokenizer_digest)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.module(torch.randn(2, 4)).square().sum().backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.position.step += 1
            self.position.cursor += 8
            self.first.total += 1
            self.second.mine += 10

    def load(self):
        return self.manager.load(self.model.checkpointed(self.module.state_dict()))


def test_the_manager_loads_what_it_saves_in_the_order_of_its_parts(ctx, tmp_path):
    run = Run(ctx, tmp_path)
    run.train(3)
    assert run.manager.save(now=True)
    assert run.calls == ["buffers agreed", "save first", "save second"]  # the model's made final before it is read
    assert run.manager.last_saved_step == 3 and [s for s, _ in committed_steps(tmp_path)] == [3]
    weights = {k: v.clone() for k, v in run.module.state_dict().items()}
    momentum = run.optimizer.state[run.module.weight]["momentum_buffer"].clone()
    run.train(2)  # what the checkpoint does not hold

    restarted = Run(ctx, tmp_path)
    loaded = restarted.load()
    assert loaded is not None and loaded.path == tmp_path / "step-3"
    assert restarted.calls == ["load first", "load second"]  # (the model part records nothing of its load)
    assert vars(restarted.position) == {"step": 3, "epoch": 0, "cursor": 24, "global_batch_size": 8, "world_size": 1}
    assert (restarted.first.total, restarted.second.mine) == (3, 30)
    assert all(torch.equal(restarted.module.state_dict()[k], v) for k, v in weights.items())
    assert torch.equal(restarted.optimizer.state[restarted.module.weight]["momentum_buffer"], momentum)
    assert restarted.manager.last_saved_step == 3  # the manager's own bookkeeping: the step is saved already
    assert not restarted.manager.save(now=True)  # ... so the end of a run that resumed at its last step saves nothing


def test_the_trainer_pt_holds_each_parts_keys_and_every_ranks_own(ctx, tmp_path):
    run = Run(ctx, tmp_path, tokenizer_digest="abc")
    run.train(1)
    run.manager.save(now=True)
    trainer = run.load().trainer
    assert {"first_total", "second_total", "param_groups", "tokenizer_digest", "rng"} <= trainer.keys()
    assert trainer["rng"] == [{"first_mine": 0, "second_mine": 10}]  # by rank
    assert trainer["tokenizer_digest"] == "abc"


def test_the_schedule_decides_and_a_step_is_saved_once(ctx, tmp_path):
    run = Run(ctx, tmp_path, save_every_steps=2)
    run.train(1)
    assert not run.manager.save(timed=False)  # step 1: not due
    run.train(1)
    assert run.manager.save(timed=False)  # step 2
    assert not run.manager.save(now=True)  # saved already
    run.train(1)
    assert run.manager.save(timed=True)  # the vote's agreed minutes
    assert [s for s, _ in committed_steps(tmp_path)] == [3, 2]


def test_an_async_save_counts_once_wait_agreed_it_committed(ctx, tmp_path):
    run = Run(ctx, tmp_path, async_checkpoint=True)
    run.train(2)
    assert run.manager.save(now=True)
    assert run.manager.pending_step == 2
    run.manager.wait()
    assert run.manager.last_saved_step == 2 and [s for s, _ in committed_steps(tmp_path)] == [2]
    restarted = Run(ctx, tmp_path, async_checkpoint=True)
    assert restarted.load().position.step == 2 and restarted.first.total == 2


def test_a_best_request_keeps_the_checkpoint_as_best(ctx, tmp_path):
    run = Run(ctx, tmp_path)
    run.train(2)
    assert run.manager.save(best={"step": 2, "metric": "loss", "value": 0.5})  # due because of the request
    assert manifest_step(tmp_path / BEST) == 2
    assert json.loads((tmp_path / BEST / "best.json").read_text())["value"] == 0.5
    run.manager.confirm_best()


def test_no_resume_asked_loads_nothing(ctx, tmp_path):
    run = Run(ctx, tmp_path)
    run.train(2)
    run.manager.save(now=True)
    restarted = Run(ctx, tmp_path, auto_resume=False)
    assert restarted.load() is None
    assert restarted.position.step == 0 and restarted.calls == [] and restarted.manager.last_saved_step == -1


def test_changed_settings_or_tokenizer_are_refused_unless_accepted(ctx, tmp_path):
    config = TrainConfig().to_dict()
    run = Run(ctx, tmp_path, config=config, tokenizer_digest="a" * 64)
    run.train(1)
    run.manager.save(now=True)
    changed = {**config, "lr": config["lr"] * 2}
    with pytest.raises(UsageError, match=r"lr .* -> .*--accept_config_change"):
        Run(ctx, tmp_path, config=changed, tokenizer_digest="a" * 64).load()
    with pytest.raises(UsageError, match="its files changed"):
        Run(ctx, tmp_path, config=config, tokenizer_digest="b" * 64).load()
    accepted = Run(ctx, tmp_path, config=changed, tokenizer_digest="b" * 64, accept_config_change=True)
    assert accepted.load().position.step == 1 and accepted.first.total == 1


def test_an_unusable_newest_checkpoint_falls_back_to_the_one_before(ctx, tmp_path):
    run = Run(ctx, tmp_path)
    run.train(2)
    run.manager.save(now=True)
    run.train(2)
    run.manager.save(now=True)
    (tmp_path / "step-4" / "trainer.pt").write_bytes(b"not what the manifest says")
    restarted = Run(ctx, tmp_path)
    assert restarted.load().position.step == 2 and restarted.first.total == 2


def test_a_part_shares_out_every_ranks_state_on_another_world_size():
    """Two ranks' stop requests loaded into one: rank 0 casts the one not yet agreed on; its RNG streams are
    reseeded (the data order never reads them)."""
    vote, run_view = SimpleNamespace(settled=None), SimpleNamespace(stop_reason=None)
    part = LoopState(vote, run_view)
    saved = {"shared": {"stopped": None, "last_eval": {"step": 4}, "stop_voted": True},
             "ranks": RankStates([{"stop_request": None}, {"stop_request": "asked on rank 1"}], 0, 1)}
    part.load_state_dict(saved)
    assert run_view.stop_reason == "asked on rank 1" and part.last_eval == {"step": 4}
    assert vote.settled == [0.0, 0.0, 0.0, 1.0]  # the stop voted but not yet read at the save

    streams = RngState(torch.device("cpu"), seed=0)
    before = streams.state_dict()["rank"]
    reseed = {"ranks": RankStates([{}, {}], 0, 1), "checkpoint": SimpleNamespace(position=Position(4, 0, 32, 8, 2))}
    try:
        streams.load_state_dict(reseed)
        reseeded = torch.get_rng_state()
        streams.load_state_dict(reseed)
        assert torch.equal(torch.get_rng_state(), reseeded) and not torch.equal(reseeded, before["torch"])
    finally:
        streams.load_state_dict({"ranks": RankStates([before], 0, 1)})  # this process's streams as they were
