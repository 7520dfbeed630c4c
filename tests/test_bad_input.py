"""A user's mistake is one line naming the cause and the fix, exit 2, before training (issue 22); a genuine failure
is exit 1, one line per rank on the console and its traceback once, in the rank log. The plug-ins with the
mistakes are in bad_plugins.py. What needs no second rank runs in this process; agreement across ranks and
DDP's unused parameters on 2 real processes (gloo)."""

from __future__ import annotations

import datetime
import json
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from helpers import TINY, run_cli, train

# (flags, words the one line must hold: the plug-in, the item or key, the fix)
GPT_SMALL = ["--seq_len", "16", "--num_layers", "1", "--num_heads", "2"]
BAD_INPUTS = {
    "float64 inputs": (["--dataset", "bad_plugins:float64_images"],
                       ["--dataset bad_plugins:float64_images", "float64 at [0]", "float32", ".float()"]),
    "an item that is None": (["--dataset", "bad_plugins:none_item"],
                             ["--dataset bad_plugins:none_item", "item 3 is None", "collate_fn"]),
    "items of different keys": (["--dataset", "bad_plugins:mixed_items"],
                                ["--dataset bad_plugins:mixed_items", "item 5 has keys ['label', 'x']",
                                 "item 0 has ['labels', 'x']", "same structure"]),
    "a per-sample loss": (["--task", "bad_plugins:per_sample_loss"],
                          ["--task bad_plugins:per_sample_loss", "shape (32,)", ".mean()", "LossSum"]),
    "a LossSum of per-sample losses": (["--task", "bad_plugins:per_sample_sum"],
                                       ["--task bad_plugins:per_sample_sum", "LossSum", "shape (32,)", ".sum()"]),
    "a metric in Python ints": (["--task", "bad_plugins:int_metric"],
                                ["--task bad_plugins:int_metric", "metric 'accuracy'", "an int", "scalar tensor"]),
    "a metric without its count": (["--task", "bad_plugins:unpaired_metric"],
                                   ["--task bad_plugins:unpaired_metric", "metric 'accuracy'", "(sum, count)"]),
    "token windows for classification": (["--dataset", "pydoc", "--model", "gpt", "--seq_len", "16", "--num_layers",
                                          "1", "--num_heads", "2"],
                                         ["--dataset pydoc", "token", "--task classification",
                                          "--task language_model"]),
    "a token model on images": (["--model", "gpt", *GPT_SMALL],
                                ["--model gpt", "looks up token ids", "--dataset synthetic",
                                 "floating-point values at [0]", "--task language_model"]),
    "a model plug-in that returns no module": (["--model", "bad_plugins:not_a_module"],
                                               ["--model bad_plugins:not_a_module", "returned dict",
                                                "not a torch.nn.Module"]),
    "a dataset plug-in that returns one dataset": (["--dataset", "bad_plugins:one_dataset"],
                                                   ["--dataset bad_plugins:one_dataset",
                                                    "(train_dataset, eval_dataset or None)"]),
    "a stream shorter than its readers": (["--dataset", "bad_plugins:short_stream", "--num_workers", "2"],
                                          ["ShortStream", "2 readers", "1 process(es) x 2 loader worker(s)",
                                           "--batch_size"]),
}


def the_line(code: int, stderr: str) -> str:
    """Assert a usage error's console: exit 2, no traceback, the last line `ddptrain: error: ...`; return it."""
    assert code == 2, (code, stderr[-3000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    line = [line for line in stderr.splitlines() if line.strip()][-1]
    assert line.startswith("ddptrain: error: "), stderr[-3000:]
    return line


def trained_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return sum(row["split"] == "train" for row in rows)


@pytest.mark.parametrize("flags, words", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_a_bad_input_is_one_line_and_exit_2_before_training(tmp_path, capfd, flags, words):
    from ddptrain import cli

    code = cli.main(["train", *TINY, "--run_dir", str(tmp_path), "--max_steps", "2", *flags])
    line = the_line(code, capfd.readouterr().err)
    assert all(word in line for word in words), (words, line)
    assert trained_steps(tmp_path) == 0


def test_a_model_function_given_to_fit_that_returns_no_module_is_named(tmp_path):
    import ddptrain
    from ddptrain.config import resolve_config

    cfg = resolve_config([*TINY, "--run_dir", str(tmp_path), "--max_steps", "2"])
    with pytest.raises(ddptrain.UsageError, match="the model function given to ddptrain.fit: the function "
                                                  "returned dict, not a torch.nn.Module"):
        ddptrain.fit(model=lambda cfg: {"width": cfg.width}, config=cfg)
    assert trained_steps(tmp_path) == 0


def test_a_token_model_on_images_is_the_same_line_where_fsdp_splits_its_embedding(tmp_path):
    """Under fsdp the embedding is split by vocabulary rows (parallel/vocab.py), whose lookup refuses float inputs
    as a whole nn.Embedding does: the same one line, not "a token id outside the embedding's rows"."""
    proc = run_cli(["train", *TINY, "--nproc", "2", "--strategy", "fsdp", "--model", "gpt", *GPT_SMALL,
                    "--run_dir", str(tmp_path), "--max_steps", "2"])
    line = the_line(proc.returncode, proc.stderr)
    assert "--model gpt looks up token ids" in line and "floating-point values at [0]" in line, line
    assert "split by vocabulary rows" in (tmp_path / "logs" / "rank-0.log").read_text()  # the split was on
    assert trained_steps(tmp_path) == 0


def test_one_ranks_bad_item_stops_every_rank_with_that_ranks_line(tmp_path):
    # Item 40 is in rank 1's first batch only: rank 0 stops too, before its first step, with rank 1's words.
    proc = train(tmp_path, "--dataset", "bad_plugins:none_item_of_rank_1", "--max_steps", "2", nproc=2, check=False)
    line = the_line(proc.returncode, proc.stderr)
    assert "--dataset bad_plugins:none_item_of_rank_1: item 40 is None" in line, line
    assert proc.stderr.count("ddptrain: error:") == 1, proc.stderr
    for rank in (0, 1):
        log = (tmp_path / "logs" / f"rank-{rank}.log").read_text()
        assert "stopping: the first batch of rank 1: --dataset bad_plugins:none_item_of_rank_1" in log, log
    assert trained_steps(tmp_path) == 0


def test_a_parameter_the_loss_never_uses_is_named_and_find_unused_parameters_trains_it(tmp_path):
    flags = ["--model", "bad_plugins:unused_head", "--max_steps", "2"]
    refused = train(tmp_path / "refused", *flags, nproc=2, check=False)
    line = the_line(refused.returncode, refused.stderr)
    assert ("--model bad_plugins:unused_head: 2 trainable parameter(s) (aux_head.weight, aux_head.bias) got no "
            "gradient") in line and "--find_unused_parameters" in line, line
    assert trained_steps(tmp_path / "refused") == 0
    train(tmp_path / "allowed", *flags, "--find_unused_parameters", nproc=2)
    assert trained_steps(tmp_path / "allowed") == 2


def test_a_genuine_failure_is_exit_1_with_one_line_and_its_traceback_once_in_the_rank_log(tmp_path, capfd):
    from ddptrain import cli

    code = cli.main(["train", *TINY, "--run_dir", str(tmp_path), "--max_steps", "4", "--task",
                     "bad_plugins:fails_at_step_3"])
    out, err = capfd.readouterr()
    assert code == 1, err
    assert "Traceback" not in out + err, out + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"ddptrain: rank 0 on host {socket.gethostname()} failed at step 2: RuntimeError: the disk went "
                     f"away (traceback in {tmp_path / 'logs' / 'rank-0.log'})"], err
    log = (tmp_path / "logs" / "rank-0.log").read_text()
    assert log.count("Traceback (most recent call last)") == 1, log
    assert log.count("RuntimeError: the disk went away") == 1, log


def ddp_unused_parameter_error() -> RuntimeError:
    """The error torch's DDP raises at the step after one that left a parameter without a gradient (world of 1)."""
    from bad_plugins import WithUnusedHead

    cfg = SimpleNamespace(in_channels=3, image_size=8, width=16, num_classes=4)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        model = torch.nn.parallel.DistributedDataParallel(WithUnusedHead(cfg))
        for _ in range(2):
            model(torch.randn(2, 3, 8, 8)).sum().backward()
    except RuntimeError as exc:
        return exc
    finally:
        dist.destroy_process_group()
    raise AssertionError("DDP did not raise")


def test_ddps_unused_parameter_error_at_a_later_step_is_a_usage_error_naming_them():
    from bad_plugins import WithUnusedHead

    from ddptrain.loop.sanity import usage_error_of

    cfg = SimpleNamespace(in_channels=3, image_size=8, width=16, num_classes=4)
    usage = usage_error_of(ddp_unused_parameter_error(), WithUnusedHead(cfg), "--model bad_plugins:unused_head")
    assert usage is not None and "\n" not in str(usage)
    assert "--model bad_plugins:unused_head: 2 trainable parameter(s) (aux_head.weight, aux_head.bias)" in str(usage)
    assert "--find_unused_parameters" in str(usage)
    assert usage_error_of(RuntimeError("the disk went away"), None, "--model mlp") is None


def test_the_launcher_names_a_rank_that_died_silently_before_the_peer_that_lost_it(tmp_path):
    """A rank killed without a word leaves no error; the peer on its host that lost it records its end for it
    (watchdog.record_vanished_peers). The launcher names a rank's own error first, then such a recorded end,
    and a lost connection last, whatever their timestamps."""
    from ddptrain.parallel.launch import _failure_outcome
    from ddptrain.parallel.procenv import VANISHED

    def failure(text: str, timestamp: int) -> SimpleNamespace:
        message = {"message": text, "extraInfo": {"timestamp": str(timestamp)}}
        recorded = tmp_path / f"error-{timestamp}.json"  # each rank wrote its own (or a peer wrote it, for VANISHED)
        recorded.write_text(json.dumps({"message": message}))
        return SimpleNamespace(exitcode=1, message=message, timestamp=timestamp, error_file_data={"message": message},
                               error_file=str(recorded))

    lost = failure("RuntimeError: [pair.cc:537] Read error [127.0.0.1]:3818: Connection reset by peer", 1)
    vanished = failure(f"{VANISHED}its process (pid 42) ended without an error of its own", 5)
    (line,) = _failure_outcome(SimpleNamespace(failures={0: lost, 1: vanished}), tmp_path, 0.0, "training").lines
    assert "rank 1 on host" in line and ": its process (pid 42) ended without an error of its own (also failed: " \
        "rank 0)" in line, line
    own = failure("ValueError: a bad batch", 9)
    (line,) = _failure_outcome(SimpleNamespace(failures={0: lost, 1: vanished, 2: own}), tmp_path, 0.0,
                               "training").lines
    assert "rank 2 on host" in line and "ValueError: a bad batch" in line, line


def test_the_launcher_reports_the_first_line_of_a_workers_error(tmp_path):
    from ddptrain.parallel.launch import _failure_outcome

    error = ddp_unused_parameter_error()
    message = {"message": f"RuntimeError: {error}", "extraInfo": {"timestamp": "0"}}
    recorded = tmp_path / "error.json"
    recorded.write_text(json.dumps({"message": message}))
    failure = SimpleNamespace(exitcode=1, message=message, timestamp=0, error_file_data={"message": message},
                              error_file=str(recorded))
    outcome = _failure_outcome(SimpleNamespace(failures={0: failure}), tmp_path, 0.0, "training")
    assert outcome.code == 1 and len(outcome.lines) == 1
    line = outcome.lines[0]
    assert "\n" not in line
    assert "rank 0 on host" in line and "RuntimeError: Expected to have finished reduction in the prior iteration" \
        in line, line
