"""The one TrainConfig: flags, TOML, precedence, the resolved config.toml, and one-line usage errors."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pipeline_runs as runs
import pytest
from helpers import TINY, cli_in_process, one_line_error, run_cli, train

from ddptrain.config import SECTIONS, TrainConfig, load_toml, resolve_config, to_toml
from ddptrain.settings import FIELDS, value_type
from ddptrain.errors import UsageError

# The seed article's flags: each keeps its name and meaning. Values differ from the defaults on purpose.
SEED_FLAGS = {
    "num_classes": 7, "in_channels": 1, "image_size": 12, "dataset_size": 123, "batch_size": 5,
    "num_workers": 0, "epochs": 4, "lr": 0.25, "momentum": 0.8, "weight_decay": 0.001, "backend": "gloo",
    "grad_accum_steps": 3, "save_every": 2, "log_interval": 7, "seed": 123,
}
SEED_SWITCHES = ("use_amp", "enable_profiling")
SEED_PATHS = ("checkpoint_dir", "resume_from")


def test_every_seed_flag_parses(tmp_path: Path):
    resume = tmp_path / "checkpoints" / "step-3"
    resume.mkdir(parents=True)
    argv = []
    for name, value in SEED_FLAGS.items():
        argv += [f"--{name}", str(value)]
    argv += [f"--{name}" for name in SEED_SWITCHES]
    argv += ["--checkpoint_dir", str(tmp_path / "ck"), "--resume_from", str(resume)]
    cfg = resolve_config(argv)
    defaults = TrainConfig()
    for name, value in SEED_FLAGS.items():
        assert getattr(cfg, name) == value and getattr(defaults, name) != value, name
        assert type(getattr(cfg, name)) is type(getattr(defaults, name)), name
    assert cfg.use_amp is True and cfg.enable_profiling is True
    assert cfg.checkpoint_path == tmp_path / "ck"
    assert cfg.resume_from == str(resume)
    assert not resolve_config(["--use_amp", "--no-use_amp"]).use_amp, "the last of --x / --no-x wins"
    assert resolve_config(["--lr=0.5"]).lr == 0.5


def test_help_lists_every_flag_in_its_section_and_switches_in_both_forms():
    proc = cli_in_process(["train", "--help"])
    assert proc.returncode == 0, proc.stderr
    shown = set(re.findall(r"--[a-z0-9_-]+", proc.stdout))
    for table, section in SECTIONS.items():
        assert f"{table} options" in proc.stdout
        for f in dataclasses.fields(section):
            assert f"--{f.name}" in shown
            if value_type(section, f.name) is bool:
                assert f"--{f.name}, --no_{f.name}" in proc.stdout  # (tyro's spelling; --no-x as well)
    assert (proc.stdout.index("data options") < proc.stdout.index("--seq_len INT") < proc.stdout.index("parallel options")
            < proc.stdout.index("--strategy {ddp,fsdp,hsdp}"))
    assert set(SEED_FLAGS) | set(SEED_SWITCHES) | set(SEED_PATHS) <= FIELDS.keys()


def test_command_line_overrides_file_overrides_defaults(tmp_path: Path):
    config = tmp_path / "exp.toml"
    config.write_text('batch_size = 8\nlr = 1\nuse_amp = true\noptimizer = "adamw"\n')
    cfg = resolve_config(["--config", str(config), "--lr", "0.2", "--no-use_amp"])
    assert cfg.batch_size == 8 and cfg.optimizer == "adamw"  # from the file
    assert cfg.lr == 0.2 and cfg.use_amp is False  # the command line wins
    assert cfg.momentum == TrainConfig().momentum  # neither: the default
    assert cfg.run_dir == str(Path("runs") / "exp"), "the default run dir is named after the config file"
    assert isinstance(load_toml(str(config))["lr"], float), "an integer in TOML is a valid float value"


def test_a_config_file_may_group_its_keys_in_sections_and_each_component_reads_its_own(tmp_path: Path):
    flat = _write(tmp_path, "flat.toml", 'model = "mlp"\nlr = 0.2\nkeep_last = 5\nsave_every_steps = 7\n'
                  "vocab_parallel = false\n")
    grouped = _write(tmp_path, "grouped.toml", '[data]\nmodel = "mlp"\n[training]\nlr = 0.2\n[checkpoint]\n'
                     "keep_last = 5\nsave_every_steps = 7\n[parallel]\nvocab_parallel = false\n")
    assert load_toml(str(grouped)) == load_toml(str(flat))
    cfg = resolve_config(["--config", str(grouped), "--run_dir", str(tmp_path / "run")])
    checkpoint = cfg.section("checkpoint")
    assert (checkpoint.keep_last, checkpoint.save_every_steps) == (5, 7)
    assert not hasattr(checkpoint, "lr") and cfg.section("training").lr == 0.2
    with pytest.raises(dataclasses.FrozenInstanceError):
        checkpoint.keep_last = 1  # a component reads its section; it does not set the run's config
    # Every key is in exactly one section.
    assert sorted(f.name for section in SECTIONS.values() for f in dataclasses.fields(section)) == sorted(
        TrainConfig().to_dict())


def test_to_toml_round_trips_awkward_values(tmp_path: Path):
    cfg = TrainConfig(run_dir='runs/a "quoted" \\ dir', lr=1e-4, use_amp=True, inject_fault="", seed=0)
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    assert resolve_config(["--config", str(path)], validate=False) == cfg
    import tomllib

    assert tomllib.loads(path.read_text())["lr"] == 1e-4, "each key at the top level, as scripts read config.toml"


def test_a_runs_resolved_config_round_trips_through_config(tmp_path_factory):
    single = runs.single(tmp_path_factory)
    text = (single / "config.toml").read_text()
    cfg = resolve_config(["--config", str(single / "config.toml")])
    assert to_toml(cfg) == text
    assert cfg.run_dir == str(single) and cfg.dataset_size == runs.NUM_TRAIN and cfg.record_sample_ids
    # A real run driven by that file (plus three flags) resolved to the same config but for those flags.
    accum = runs.accum_1x4(tmp_path_factory)
    changed = dict(run_dir=str(accum), batch_size=8, grad_accum_steps=4)
    assert resolve_config(["--config", str(accum / "config.toml")]) == dataclasses.replace(cfg, **changed)


# --- bad input: exit 2, one line on stderr naming the flag, no traceback ----------------------------

def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


BAD_INPUT = {
    # id: (argv after `train` (tmp_path is substituted for {tmp}), extra env, expected text in the line)
    "out-of-range value": (["--batch_size", "0"], {}, "--batch_size must be >= 1"),
    "negative lr": (["--lr", "-0.1"], {}, "--lr"),
    "nan lr": (["--lr", "nan"], {}, "--lr must be a finite number"),
    "inf in a toml file": (["--config", "{tmp}/inf.toml"], {}, "--grad_clip must be a finite number"),
    "static_graph with accumulation": (["--static_graph", "--grad_accum_steps", "2"], {},
                                       "--static_graph cannot be combined with --grad_accum_steps"),
    "wrong type": (["--epochs", "two"], {}, "--epochs expects int"),
    "bad choice": (["--optimizer", "adam"], {}, "--optimizer"),
    "missing value": (["--lr"], {}, "--lr"),
    "unknown flag": (["--batchsize", "8"], {}, "did you mean --batch_size"),
    "unknown toml key": (["--config", "{tmp}/unknown.toml"], {},
                         "unknown key 'batchsize'; did you mean 'batch_size'"),
    "toml wrong type": (["--config", "{tmp}/typed.toml"], {}, "batch_size = '8' should be int"),
    "malformed toml": (["--config", "{tmp}/broken.toml"], {}, "malformed TOML"),
    "toml key in another section": (["--config", "{tmp}/misplaced.toml"], {},
                                    "lr belongs in [training], not [checkpoint]"),
    "unknown toml section": (["--config", "{tmp}/section.toml"], {}, "unknown table [optimiser]; the sections are"),
    "toml key set twice": (["--config", "{tmp}/twice.toml"], {}, "keep_last is set twice"),
    "missing config file": (["--config", "{tmp}/nowhere.toml"], {}, "no such file"),
    "unimportable plug-in": (["--model", "no_such_package.models:build"], {}, "--model"),
    "plug-in raising on import": (["--dataset", "broken_plugin:dataset"], {"PYTHONPATH": "{tmp}"}, "--dataset"),
    "plug-in without the function": (["--model", "json:no_such_fn"], {}, "no callable 'no_such_fn'"),
    "plug-in without a colon part": (["--model", "json:"], {}, "'package.module:function'"),
    "unknown built-in model": (["--model", "resnet9000"], {}, "--model 'resnet9000'"),
    "resume_from missing": (["--resume_from", "{tmp}/no/step-3"], {}, "--resume_from"),
    "bad fault spec": (["--inject_fault", "rank=one"], {}, "--inject_fault"),
    "half-set launcher env": ([], {"RANK": "0"}, "half-set"),
    "--nproc inside a launcher": (["--nproc", "2"], {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                                                      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29599"},
                                  "--nproc"),
    "sync_batchnorm on CPU": (["--sync_batchnorm"], {}, "--sync_batchnorm"),
    "fp16 on CPU": (["--use_amp", "--amp_dtype", "fp16"], {}, "--amp_dtype fp16"),
    "channels_last on CPU": (["--channels_last"], {}, "--channels_last"),
    "nccl on CPU": (["--backend", "nccl"], {}, "--backend nccl"),
    "bad value under --nproc": (["--nproc", "2", "--momentum", "-1"], {}, "--momentum"),
    "load_best_at_end without keep_best": (["--load_best_at_end"], {}, "--load_best_at_end loads the checkpoint "
                                           "--keep_best keeps, which is off; set --keep_best"),
}
CUDA_ONLY_ERRORS = ("sync_batchnorm on CPU", "fp16 on CPU", "nccl on CPU", "channels_last on CPU")


@pytest.fixture
def bad_files(tmp_path: Path) -> Path:
    _write(tmp_path, "unknown.toml", "batchsize = 8\n")
    _write(tmp_path, "typed.toml", 'batch_size = "8"\n')
    _write(tmp_path, "broken.toml", "lr = = 0.1\n")
    _write(tmp_path, "inf.toml", "grad_clip = inf\n")
    _write(tmp_path, "misplaced.toml", "[checkpoint]\nkeep_last = 2\nlr = 0.1\n")
    _write(tmp_path, "section.toml", "[optimiser]\nlr = 0.1\n")
    _write(tmp_path, "twice.toml", "keep_last = 2\n[checkpoint]\nkeep_last = 4\n")
    _write(tmp_path, "broken_plugin.py", "raise RuntimeError('this plug-in is broken')\n")
    return tmp_path


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_exits_2_with_one_line(case: str, bad_files: Path):
    argv, env, expected = BAD_INPUT[case]
    if case in CUDA_ONLY_ERRORS:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CPU-only error")
    fill = lambda s: s.replace("{tmp}", str(bad_files))  # noqa: E731
    proc = cli_in_process(["train", *map(fill, argv)], env={k: fill(v) for k, v in env.items()})
    line = one_line_error(proc)
    assert line.startswith("ddptrain: error: ")
    assert expected in line, line
    assert proc.stdout == ""


def test_unknown_command_exits_2_with_one_line():
    line = one_line_error(cli_in_process(["trian"]))
    assert "unknown command 'trian'" in line and "train" in line


def test_a_bad_input_ends_the_process_itself_with_exit_2_and_one_line():
    """The cases above run the CLI's `main` in this process; `python -m ddptrain` itself (its interpreter's exit
    code, its stderr) keeps the contract too, for a bad flag and an unknown command."""
    proc = run_cli(["train", "--batch_size", "0"])
    assert one_line_error(proc).startswith("ddptrain: error: --batch_size must be >= 1") and proc.stdout == ""
    assert "unknown command 'trian'" in one_line_error(run_cli(["trian"]))


def test_a_command_run_in_this_process_leaves_the_process_as_it_found_it(tmp_path):
    """cli_in_process (tests/helpers.py) gives the command what a process of its own would have (the environment,
    the working directory, PYTHONPATH's plug-ins) and takes it all back, so that the tests after it are unaffected."""
    import logging
    import os
    import sys

    (tmp_path / "plugin_in_cwd.py").write_text("def model(cfg):\n    raise AssertionError('never built')\n")
    state = lambda: (dict(os.environ), list(sys.path), os.getcwd(), logging.getLogger().handlers[:])  # noqa: E731
    before = state()
    proc = cli_in_process(["train", "--model", "plugin_in_cwd:model", "--dataset", "cifar10", "--data_dir", "nope"],
                          cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})  # imports the plug-in, then refuses
    assert "--data_dir nope: no such directory" in one_line_error(proc)
    assert state() == before and "plugin_in_cwd" not in sys.modules


LR_WARNING = "linear scaling rule (--scale_lr) would train at lr"


def test_lr_warning_once_when_the_global_batch_differs_and_lr_is_not_scaled(tmp_path: Path):
    """Under SGD, an --lr tuned for another global batch is said once (rank 0's log, in this process); not under
    --scale_lr, at the base batch, with the default lr, or under AdamW (a fine-tune's: linear scaling is SGD's
    rule; it was said on every fine-tune)."""
    import ddptrain

    expected = ("global batch 32 differs from --base_batch_size 256, the batch --lr 0.1 was tuned for: the linear "
                "scaling rule (--scale_lr) would train at lr 0.0125 (x0.125); training at 0.1")
    ddptrain.fit(config=resolve_config([*TINY, "--max_steps", "2", "--eval_size", "0", "--save_every", "0",
                                        "--run_dir", str(tmp_path)]))
    assert (tmp_path / "logs" / "rank-0.log").read_text().count(LR_WARNING) == 1
    said = lambda *flags: resolve_config([*TINY, *flags]).lr_scaling_warning(32)  # noqa: E731
    assert said() == expected
    for flags in (["--scale_lr"], ["--base_batch_size", "32"], ["--lr", "0.01"], ["--optimizer", "adamw"]):
        assert said(*flags) is None, flags


@pytest.mark.parametrize("name", ["quickstart", "digits"])
def test_shipped_configs_train_at_the_batch_their_lr_was_tuned_for(name: str):
    cfg = resolve_config(["--config", str(Path(__file__).parents[1] / "configs" / f"{name}.toml")], validate=False)
    assert cfg.nproc * cfg.batch_size * cfg.grad_accum_steps == cfg.base_batch_size, "no linear scaling warning"


def test_defaults_are_the_seed_articles_except_amp():
    """The seed article's defaults, kept (docs/configuration.md lists the one difference and its reason)."""
    cfg = TrainConfig()
    assert (cfg.batch_size, cfg.lr, cfg.weight_decay, cfg.num_workers) == (64, 0.01, 1e-4, 4)
    assert cfg.use_amp is False  # the seed's is on: fp32 exactness, the peers' default, CPU-dependent speed



def test_validation_is_a_pure_check_and_preflight_checks_devices_and_plug_ins(tmp_path):
    """TrainConfig.validate reads the config alone and changes nothing (issue 38: settings a component can own);
    what needs a device, an import or a file is preflight's, and resolution (`settle`) fills in what settings
    imply."""
    import copy

    from ddptrain.preflight import check

    cfg = TrainConfig(model="no_such_package.models:build", callbacks="no_such_package:Callback",
                      tracker="tensorboard", resume_from="checkpoints/step-3", run_dir=str(tmp_path))
    before = copy.deepcopy(cfg)
    cfg.validate()
    assert cfg == before
    with pytest.raises(UsageError, match="--callbacks 'no_such_package:Callback'"):
        check(cfg)
    (tmp_path / "checkpoints" / "step-3").mkdir(parents=True)
    cfg.settle()
    assert cfg.tensorboard and cfg.resume_from == str(tmp_path / "checkpoints" / "step-3")


@pytest.mark.parametrize("argv, words", [
    (["--vocab_parallel"], "--vocab_parallel splits the embedding and head by rows under --strategy fsdp only "
                           "(under ddp each rank holds whole matrices)"),
    (["--vocab_parallel", "--strategy", "hsdp"], "(under hsdp each rank holds FSDP units)"),
    (["--lora_alpha", "32"], "--lora_alpha scales LoRA adapters, which are off; set --lora_rank"),
    (["--lora_alpha", "16"], "--lora_alpha scales LoRA adapters"),  # the default's value, asked for all the same
])
def test_a_flag_whose_default_is_on_is_refused_where_it_would_be_ignored(tmp_path, argv, words):
    """--vocab_parallel (on by default) under ddp, --lora_alpha (16 by default) without --lora_rank: accepted and
    ignored before, where their siblings (--cpu_offload under ddp, --lora_dropout without --lora_rank) are exit 2.
    Asked on the command line or of `fit`; a config file is not asked (RUN_DIR/config.toml holds every value)."""
    import ddptrain
    from ddptrain.config import resolve_config

    with pytest.raises(UsageError) as refused:
        resolve_config(argv)
    assert words in str(refused.value)
    overrides = {"vocab_parallel": True} if argv[0] == "--vocab_parallel" else {"lora_alpha": float(argv[1])}
    with pytest.raises(UsageError, match=re.escape(words)):
        ddptrain.fit(strategy=argv[2] if len(argv) > 2 else "ddp", run_dir=str(tmp_path / "run"), **overrides)
    resolve_config([*argv, "--strategy", "fsdp", "--lora_rank", "8"])  # where they apply
    saved = tmp_path / "config.toml"
    saved.write_text("vocab_parallel = true\nlora_alpha = 16.0\nstrategy = \"ddp\"\n")
    resolve_config(["--config", str(saved)])


def test_a_boolean_flag_takes_true_or_false_as_users_spell_it():
    """`--progress false` was "unknown flag false": a switch takes --x, --x true/false (yes/no, on/off, 1/0) and
    --no-x; anything else is one line naming the flag and the spellings. --help shows each switch once."""
    from ddptrain.config import resolve_config

    said = {tuple(argv): resolve_config([*argv, "--lr", "0.1"], validate=False).progress
            for argv in (["--progress", "false"], ["--progress=No"], ["--progress", "1"], ["--progress"],
                         ["--no-progress"], [])}
    assert said == {("--progress", "false"): False, ("--progress=No",): False, ("--progress", "1"): True,
                    ("--progress",): True, ("--no-progress",): False, (): True}
    with pytest.raises(UsageError, match=r"^--progress maybe: not true or false; pass --progress \(true\), "
                                         r"--no-progress \(false\), or --progress false$"):
        resolve_config(["--progress", "maybe"], validate=False)
    with pytest.raises(UsageError, match="--no-progress takes no value"):
        resolve_config(["--no-progress", "false"], validate=False)
    assert "A switch is --x, --no-x, or --x true/false." in cli_in_process(["train", "--help"]).stdout


def test_a_transformer_trains_with_a_fine_tuners_defaults_unless_set():
    """--task language_model (or any hf: model) takes AdamW, no weight decay, 3 % warmup then cosine, clipping at 1,
    one loader worker and an lr for what trains, each where no flag set it; images keep the seed's defaults."""
    lm = ["--task", "language_model", "--model", "gpt", "--dataset", "pydoc"]
    picked = lambda cfg: (cfg.optimizer, cfg.lr, cfg.weight_decay, cfg.lr_schedule, cfg.warmup_ratio,  # noqa: E731
                          cfg.grad_clip, cfg.num_workers)
    assert picked(resolve_config(lm)) == ("adamw", 3e-4, 0.0, "cosine", 0.03, 1.0, 1)
    assert picked(resolve_config([])) == ("sgd", 0.01, 1e-4, "constant", 0.0, 0.0, 4)
    assert picked(resolve_config([*lm, "--optimizer", "sgd", "--lr", "0.1", "--num_workers", "0"]))[:2] == ("sgd", 0.1)
    assert resolve_config([*lm, "--warmup_steps", "5"]).warmup_ratio == 0.0
    assert resolve_config([*lm, "--lora_rank", "8"]).lr == 2e-4  # (validate reads no model files)
    whole = TrainConfig(task="classification", model="hf:somewhere", dataset="hf:rows.jsonl")
    whole.settle()
    assert (whole.optimizer, whole.lr) == ("adamw", 2e-5)
    with pytest.raises(UsageError, match="--warmup_steps 5 and --warmup_ratio 0.1 both say how long"):
        resolve_config([*lm, "--warmup_steps", "5", "--warmup_ratio", "0.1"])


def test_a_run_resumed_keeps_what_it_trained_with_where_the_defaults_decided(tmp_path):
    """A language model's run started before its defaults changed (here: trained under SGD at 0.01, constant) goes
    on with those, not refused as changed settings, and not switched to AdamW mid-run; a flag still decides
    (--accept_config_change aside, a changed one is refused). In this process."""
    import ddptrain
    from ddptrain.config import load_toml

    lm = ["--task", "language_model", "--model", "gpt", "--dataset", "lm_plugins:masked_lm", "--vocab_size", "64",
          "--seq_len", "16", "--width", "16", "--num_layers", "1", "--num_heads", "2", "--dataset_size", "64",
          "--eval_size", "8", "--batch_size", "4", "--num_workers", "0", "--no-progress", "--save_every", "0",
          "--save_every_steps", "2", "--run_dir", str(tmp_path)]
    before = ["--optimizer", "sgd", "--lr", "0.01", "--weight_decay", "1e-4", "--lr_schedule", "constant",
              "--grad_clip", "0"]
    ddptrain.fit(config=resolve_config([*lm, *before, "--max_steps", "2"]))
    summary = ddptrain.fit(config=resolve_config([*lm, "--max_steps", "4"]))
    assert summary["step"] == 4
    kept = load_toml(str(tmp_path / "config.toml"))
    assert (kept["optimizer"], kept["lr"], kept["lr_schedule"], kept["grad_clip"]) == ("sgd", 0.01, "constant", 0.0)
    with pytest.raises(UsageError, match="was trained with other settings \\(optimizer 'sgd' -> 'adamw'\\)"):
        ddptrain.fit(config=resolve_config([*lm, "--max_steps", "6", "--optimizer", "adamw"]))


def test_each_section_is_typed_checks_its_own_rules_and_the_config_joins_them():
    """Settings by component: a section's rules need no other section; a rule that joins two is the config's."""
    from ddptrain.settings import DataSettings, FinetuneSettings, ParallelSettings, choices

    assert choices(ParallelSettings, "strategy") == ("ddp", "fsdp", "hsdp")
    assert value_type(ParallelSettings, "strategy") is str and value_type(DataSettings, "packing") is bool
    with pytest.raises(UsageError, match="^--packing places token rows for --task language_model"):
        DataSettings(packing=True).validate()
    with pytest.raises(UsageError, match=r"^--lora_dora configures LoRA adapters, which are off"):
        FinetuneSettings(lora_dora=True).validate()
    FinetuneSettings(lora_rank=8, lora_dora=True).validate()  # alone it is fine: the strategy is another section's
    with pytest.raises(UsageError, match="^--lora_dora works with --strategy ddp only"):
        TrainConfig(lora_rank=8, lora_dora=True, strategy="fsdp").validate()
    cfg = TrainConfig(lr=0.5, strategy="fsdp")
    assert (cfg.training.lr, cfg.lr, cfg.section("parallel").strategy) == (0.5, 0.5, "fsdp")
    parallel = cfg.parallel
    cfg.strategy = "hsdp"  # the config holds a new section; what a component was given stays as it was
    assert (cfg.strategy, parallel.strategy) == ("hsdp", "fsdp")
    with pytest.raises(dataclasses.FrozenInstanceError):
        parallel.strategy = "ddp"
    assert cfg.replace(lr=1.0).lr == 1.0 and cfg.lr == 0.5
    assert TrainConfig(training=cfg.training, seed=3).to_dict() == {**TrainConfig().to_dict(), "lr": 0.5, "seed": 3}
    with pytest.raises(TypeError, match="unknown settings lrr"):
        TrainConfig(lrr=1)
    with pytest.raises(AttributeError, match="no setting 'lrr'"):
        cfg.lrr  # noqa: B018


def test_a_switch_spelled_as_help_spells_it_counts_as_given():
    """tyro's help writes --no_x; it reads as --no-x, and a setting so given is the run's even at its default (a
    transformer's defaults do not override it)."""
    lm = ["--task", "language_model", "--model", "gpt", "--dataset", "pydoc"]
    assert resolve_config([*lm, "--no_progress"]).progress is False
    assert resolve_config([*lm, "--grad_clip", "0"]).grad_clip == 0.0  # given at the image default: kept
    assert resolve_config(lm).grad_clip == 1.0


def test_a_fit_argument_of_the_wrong_type_is_one_line(tmp_path: Path):
    import ddptrain

    with pytest.raises(UsageError, match=r"^fit\(epochs=\.\.\.\): epochs = 'two' should be int$"):
        ddptrain.fit(config=TrainConfig(run_dir=str(tmp_path)), epochs="two")
