"""Image datasets: CIFAR binary and ImageFolder fixtures written in the exact formats, digits, and bad input."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import cli_in_process, metrics, one_line_error, run_cli, train
from PIL import Image

from ddptrain.config import resolve_config
from ddptrain.data import images as image_datasets
from ddptrain.data.pipeline import SeededSamples
from ddptrain.loop.plugins import datasets_of
from ddptrain.errors import UsageError
from ddptrain.preflight import check_data

CIFAR10_MEAN = torch.tensor(image_datasets.CIFAR["cifar10"].mean).view(3, 1, 1)
CIFAR10_STD = torch.tensor(image_datasets.CIFAR["cifar10"].std).view(3, 1, 1)


# --- fixtures in the exact on-disk formats --------------------------------------------------------

def write_cifar10(directory: Path, records_per_file: int = 6, eval_records: int = 5) -> dict[str, tuple]:
    """data_batch_1..5.bin + test_batch.bin: records of <1 label byte><3072 pixel bytes, R then G then B>."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    written = {}
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    for file_no, name in enumerate(names):
        count = eval_records if name == "test_batch.bin" else records_per_file
        labels = (np.arange(count) + file_no) % 10
        pixels = rng.integers(0, 256, size=(count, 3072), dtype=np.uint8)
        records = np.concatenate([labels[:, None].astype(np.uint8), pixels], axis=1)
        (directory / name).write_bytes(records.tobytes())
        written[name] = (labels, pixels)
    return written


def write_cifar100(directory: Path) -> tuple[np.ndarray, np.ndarray]:
    """train.bin / test.bin: <1 coarse label byte><1 fine label byte><3072 pixel bytes>."""
    directory.mkdir(parents=True, exist_ok=True)
    fine = {"train.bin": np.array([99, 3, 57, 0, 42, 7, 88, 1]), "test.bin": np.array([5, 98, 64])}
    for name, labels in fine.items():
        coarse = labels // 5
        pixels = np.full((len(labels), 3072), 128, dtype=np.uint8)
        (directory / name).write_bytes(np.concatenate([coarse[:, None], labels[:, None], pixels], axis=1)
                                       .astype(np.uint8).tobytes())
    return fine["train.bin"], fine["test.bin"]


COLOURS = {"ant": (255, 0, 0), "bee": (0, 255, 0), "cat": (0, 0, 255)}


def write_image_folder(root: Path) -> None:
    """DIR/train/<class>/*.png|jpg and DIR/val/<class>/*.png, solid colours per class, assorted sizes."""
    for split, per_class in (("train", 3), ("val", 2)):
        for name, colour in COLOURS.items():
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (10 + 3 * i, 12), colour).save(folder / f"{i}.png")
    Image.new("RGB", (20, 20), COLOURS["cat"]).save(root / "train" / "cat" / "extra.jpg", quality=100)
    (root / "train" / "cat" / "notes.txt").write_text("not an image: ignored")


def cfg_for(dataset: str, data_dir: Path | str = "", *flags: str):
    """The config of `ddptrain train` with these flags, checked against the data as the command does."""
    args = ["--dataset", dataset, "--seed", "7"] + (["--data_dir", str(data_dir)] if data_dir else []) + list(flags)
    cfg = resolve_config(args)
    check_data(cfg)
    return cfg


def all_crops_and_flips(image: torch.Tensor, padding: int = 4) -> list[torch.Tensor]:
    padded = torch.nn.functional.pad(image, (padding,) * 4)
    h, w = image.shape[-2:]
    crops = [padded[:, t:t + h, s:s + w] for t in range(2 * padding + 1) for s in range(2 * padding + 1)]
    return crops + [c.flip(-1) for c in crops]


# --- CIFAR ---------------------------------------------------------------------------------------

def test_cifar10_binary_loads_labels_pixels_and_shapes(tmp_path):
    written = write_cifar10(tmp_path / "cifar-10-batches-bin")
    train_ds, eval_ds = datasets_of(cfg_for("cifar10", tmp_path))  # the parent of the extracted folder
    assert (len(train_ds), len(eval_ds)) == (30, 5)
    labels, pixels = written["data_batch_3.bin"]
    image, label = eval_ds[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32
    for index in range(6):  # samples 12..17 are the records of the third train file
        assert train_ds.targets[12 + index] == labels[index]
    eval_labels, eval_pixels = written["test_batch.bin"]
    assert [eval_ds[i][1] for i in range(5)] == eval_labels.tolist()
    # Eval: no augmentation, exactly the record's pixels (R plane, G plane, B plane) normalised.
    raw = torch.from_numpy(eval_pixels[0].astype(np.float32)).view(3, 32, 32) / 255
    assert torch.allclose(image, (raw - CIFAR10_MEAN) / CIFAR10_STD, atol=1e-6)


def test_cifar_train_augmentation_is_a_crop_and_flip_deterministic_per_seed_epoch_and_sample(tmp_path):
    written = write_cifar10(tmp_path)
    train_ds, _ = datasets_of(cfg_for("cifar10", tmp_path))
    seeded = SeededSamples(train_ds, seed=7)
    _, (first, label) = seeded[(0, 2)]
    assert label == written["data_batch_1.bin"][0][2]
    assert torch.equal(first, seeded[(0, 2)][1][0])  # same (seed, epoch, sample): same augmentation
    assert torch.equal(first, SeededSamples(train_ds, seed=7)[(0, 2)][1][0])
    raw = torch.from_numpy(written["data_batch_1.bin"][1][2].astype(np.float32)).view(3, 32, 32) / 255
    candidates = [(c - CIFAR10_MEAN) / CIFAR10_STD for c in all_crops_and_flips(raw)]
    assert any(torch.allclose(first, c, atol=1e-6) for c in candidates)
    # Other epochs and seeds draw other crops (162 possibilities: 8 draws all equal would be a bug).
    others = [seeded[(epoch, 2)][1][0] for epoch in range(1, 5)] + [SeededSamples(train_ds, s)[(0, 2)][1][0]
                                                                  for s in (8, 9, 10, 11)]
    assert not all(torch.equal(first, other) for other in others)


def test_cifar100_uses_the_fine_labels(tmp_path):
    train_fine, test_fine = write_cifar100(tmp_path)
    train_ds, eval_ds = datasets_of(cfg_for("cifar100", tmp_path, "--num_classes", "100"))
    assert [train_ds[i][1] for i in range(len(train_ds))] == train_fine.tolist()
    assert [eval_ds[i][1] for i in range(len(eval_ds))] == test_fine.tolist()
    assert train_ds[0][0].shape == (3, 32, 32)


@pytest.mark.parametrize("damage, expected", [
    ("missing", "data_batch_3.bin not found"),
    ("truncated", "not a whole number of 3073-byte CIFAR-10 records"),
    ("empty", "has 0 bytes"),
])
def test_malformed_cifar_is_a_clear_usage_error(tmp_path, damage, expected):
    write_cifar10(tmp_path)
    target = tmp_path / "data_batch_3.bin"
    if damage == "missing":
        target.unlink()
    elif damage == "truncated":
        target.write_bytes(target.read_bytes()[:-7])
    else:
        target.write_bytes(b"")
    with pytest.raises(UsageError, match=expected) as err:
        cfg_for("cifar10", tmp_path)
    assert str(err.value).startswith(f"--data_dir {tmp_path}")


def test_cifar_label_out_of_range_is_a_clear_usage_error(tmp_path):
    write_cifar10(tmp_path)
    blob = bytearray((tmp_path / "data_batch_2.bin").read_bytes())
    blob[3073] = 12  # the label byte of record 1
    (tmp_path / "data_batch_2.bin").write_bytes(bytes(blob))
    with pytest.raises(UsageError, match=r"data_batch_2.bin record 1 has label 12, but CIFAR-10 has 10 classes"):
        datasets_of(cfg_for("cifar10", tmp_path))


def test_config_flags_must_fit_the_data(tmp_path):
    write_cifar10(tmp_path)
    with pytest.raises(UsageError, match="pass --image_size 32"):
        cfg_for("cifar10", tmp_path, "--image_size", "16")
    write_cifar100(tmp_path / "c100")
    with pytest.raises(UsageError, match="CIFAR-100 has 100 classes; pass --num_classes 100"):
        cfg_for("cifar100", tmp_path / "c100")
    with pytest.raises(UsageError, match="digits images are grayscale; pass --in_channels 1"):
        cfg_for("digits", "", "--image_size", "8")
    with pytest.raises(UsageError, match="no such directory"):
        cfg_for("cifar10", tmp_path / "absent")


def test_shipped_cifar10_config_validates_against_cifar_files(tmp_path):
    write_cifar10(tmp_path)
    cfg = resolve_config(["--config", str(Path(__file__).parents[2] / "configs" / "cifar10.toml"),
                          "--data_dir", str(tmp_path)])
    check_data(cfg)
    assert (cfg.dataset, cfg.num_classes, cfg.image_size, cfg.in_channels) == ("cifar10", 10, 32, 3)


def test_cli_names_the_flag_for_a_missing_data_dir(tmp_path):
    line = one_line_error(cli_in_process(["train", "--dataset", "cifar10", "--data_dir", str(tmp_path / "nope")]))
    assert line.startswith("ddptrain: error: --data_dir") and "no such directory" in line


def test_cifar10_trains_end_to_end_with_a_loader_worker(tmp_path):
    write_cifar10(tmp_path / "data")
    run = tmp_path / "run"
    train(run, "--dataset", "cifar10", "--data_dir", str(tmp_path / "data"), "--image_size", "32",
          "--batch_size", "10", "--epochs", "1", "--num_workers", "1")
    assert [line["samples"] for line in metrics(run, "eval")] == [5]
    assert len(metrics(run, "train")) == 3


# --- ImageFolder ---------------------------------------------------------------------------------

def test_image_folder_classes_by_sorted_folder_name_and_resized_images(tmp_path):
    write_image_folder(tmp_path)
    train_ds, eval_ds = datasets_of(cfg_for("imagefolder", tmp_path, "--num_classes", "3", "--image_size", "8"))
    assert train_ds.classes == ["ant", "bee", "cat"]
    assert (len(train_ds), len(eval_ds)) == (10, 6)  # notes.txt is not an image
    assert [eval_ds[i][1] for i in range(6)] == [0, 0, 1, 1, 2, 2]
    mean = torch.tensor(image_datasets.IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(image_datasets.IMAGENET_STD).view(3, 1, 1)
    for index in range(6):
        image, label = eval_ds[index]
        colour = torch.tensor(list(COLOURS.values())[label], dtype=torch.float32).view(3, 1, 1) / 255
        assert image.shape == (3, 8, 8)
        assert torch.allclose(image, ((colour - mean) / std).expand(3, 8, 8), atol=1e-6)
    grey, _ = datasets_of(cfg_for("imagefolder", tmp_path, "--num_classes", "3", "--image_size", "8",
                                     "--in_channels", "1"))
    assert grey[0][0].shape == (1, 8, 8)


def test_image_folder_augmentation_is_deterministic_per_seed(tmp_path):
    write_image_folder(tmp_path)
    train_ds, _ = datasets_of(cfg_for("imagefolder", tmp_path, "--num_classes", "3", "--image_size", "8"))
    a, b = SeededSamples(train_ds, 3), SeededSamples(train_ds, 3)
    for key in [(0, 0), (0, 9), (1, 9)]:
        assert torch.equal(a[key][1][0], b[key][1][0])
    # Padding shows as zero (black) pixels at a crop offset: the crops are real, and vary with the epoch.
    crops = [a[(epoch, 4)][1][0] for epoch in range(8)]
    assert not all(torch.equal(crops[0], c) for c in crops[1:])


@pytest.mark.parametrize("layout, flags, expected", [
    ("no-train", [], "no train/ folder"),
    ("one-class", [], "1 class folder(s)"),
    ("ok", ["--num_classes", "10"], "has 3 class folders; pass --num_classes 3"),
    ("ok", ["--num_classes", "3", "--in_channels", "4"], "pass --in_channels 3 or 1"),
])
def test_malformed_image_folder_is_a_clear_usage_error(tmp_path, layout, flags, expected):
    if layout == "no-train":
        (tmp_path / "images").mkdir()
    elif layout == "one-class":
        (tmp_path / "train" / "only").mkdir(parents=True)
    else:
        write_image_folder(tmp_path)
    with pytest.raises(UsageError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        cfg_for("imagefolder", tmp_path, *flags)


def test_image_folder_bad_class_folders_and_files(tmp_path):
    write_image_folder(tmp_path)
    flags = ("--num_classes", "3", "--image_size", "8")
    (tmp_path / "val" / "dog").mkdir()
    with pytest.raises(UsageError, match=r"val/dog is not a class of train/"):
        datasets_of(cfg_for("imagefolder", tmp_path, *flags))
    (tmp_path / "val" / "dog").rmdir()
    for image in (tmp_path / "train" / "bee").iterdir():
        image.unlink()
    with pytest.raises(UsageError, match=r"class folder .*train/bee has no images"):
        datasets_of(cfg_for("imagefolder", tmp_path, *flags))
    Image.new("RGB", (4, 4)).save(tmp_path / "train" / "bee" / "0.png")
    (tmp_path / "train" / "bee" / "1.png").write_bytes(b"\x89PNG broken")
    train_ds, _ = datasets_of(cfg_for("imagefolder", tmp_path, *flags))
    with pytest.raises(ValueError, match=r"train/bee/1.png: not a readable image"):
        train_ds[4]


def test_image_folder_trains_end_to_end(tmp_path):
    write_image_folder(tmp_path / "data")
    run = tmp_path / "run"
    train(run, "--dataset", "imagefolder", "--data_dir", str(tmp_path / "data"), "--num_classes", "3",
          "--batch_size", "5", "--epochs", "2", "--num_workers", "1")
    assert [line["samples"] for line in metrics(run, "eval")] == [6, 6]


# --- digits --------------------------------------------------------------------------------------

def test_digits_split_is_fixed_stratified_and_disjoint():
    train_ds, eval_ds = datasets_of(cfg_for("digits", "", "--in_channels", "1", "--image_size", "8"))
    assert (len(train_ds), len(eval_ds)) == (1433, 364)
    assert train_ds[0][0].shape == (1, 8, 8)
    counts = torch.bincount(eval_ds.targets, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37  # every class held out at the same 1-in-5 rate
    again, _ = datasets_of(cfg_for("digits", "", "--in_channels", "1", "--image_size", "8", "--seed", "1"))
    assert torch.equal(train_ds.images, again.images)  # the split does not depend on --seed
    is_eval = image_datasets.digits_split(np.arange(100) % 10)
    assert is_eval.sum() == 20 and list(np.flatnonzero(is_eval[:10])) == list(range(10))


def test_missing_optional_packages_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(UsageError, match=r"pip install 'ddptrain\[digits\]'"):
        cfg_for("digits", "", "--in_channels", "1", "--image_size", "8")
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(UsageError, match=r"pip install 'ddptrain\[images\]'"):
        cfg_for("imagefolder", "/tmp")


@pytest.mark.slow
def test_digits_demo_reaches_95_percent_eval_accuracy(tmp_path):
    proc = run_cli(["train", "--config", "configs/digits.toml", "--run_dir", str(tmp_path / "run"), "--no-progress"],
                   timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = metrics(tmp_path / "run", "eval")[-1]
    assert final["accuracy"] >= 0.95, final
