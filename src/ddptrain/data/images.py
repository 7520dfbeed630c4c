"""Datasets read from files: CIFAR-10/100 binary, ImageFolder trees, and scikit-learn's digits.

`check(data)` is the cheap part (files present, sizes, config flags agree with the data) and runs in
`preflight.check_data`, so a bad directory is a one-line usage error before any process starts.
`build(data)` returns `(train, eval | None)` for `data.build_datasets`.

Images come out as normalised float tensors (C, H, W). Train augmentation — random crop from a
zero-padded image, horizontal flip — is written with the global torch RNG, which `data.SeededSamples`
seeds per (seed, epoch, sample): the same sample gets the same crop on any rank or loader worker.
Eval datasets never augment. The dataset dictates `--num_classes`, and for CIFAR and digits also
`--in_channels` and `--image_size`; a mismatch is an error naming the flag to set.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ddptrain.config import DataSettings
from ddptrain.errors import UsageError

CROP_PADDING = 4
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".pgm", ".tif", ".tiff")
# Per-channel mean and std of the data (in [0, 1]), the usual published values.
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
GRAY_MEAN, GRAY_STD = (0.449,), (0.226,)


# --- transforms as tensor ops ----------------------------------------------------------------------

class ImageTransform:
    """uint8 (C, H, W) -> float, normalised; with `augment`: random padded crop and horizontal flip."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...], augment: bool,
                 padding: int = CROP_PADDING, flip: bool = True):
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
        self.augment, self.padding, self.flip = augment, padding, flip

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        x = image.to(torch.float32).div_(255.0)
        if self.augment:
            x = random_crop(x, self.padding)
            if self.flip and bool(torch.rand(()) < 0.5):
                x = x.flip(-1)
        return (x - self.mean) / self.std


def random_crop(x: torch.Tensor, padding: int) -> torch.Tensor:
    """A crop of x's size from x zero-padded by `padding` on each side (global torch RNG)."""
    if padding <= 0:
        return x
    height, width = x.shape[-2:]
    padded = F.pad(x, (padding, padding, padding, padding))
    top, left = torch.randint(0, 2 * padding + 1, (2,)).tolist()
    return padded[..., top:top + height, left:left + width]


# --- CIFAR binary --------------------------------------------------------------------------------

@dataclass(frozen=True)
class CifarFormat:
    title: str
    folder: str  # the directory the official tarball extracts to; data_dir may be it or its parent
    train_files: tuple[str, ...]
    eval_files: tuple[str, ...]
    label_bytes: int  # the label used is the last one (CIFAR-100: coarse, then fine)
    num_classes: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @property
    def record_bytes(self) -> int:
        return self.label_bytes + 3 * 32 * 32


CIFAR = {
    "cifar10": CifarFormat("CIFAR-10", "cifar-10-batches-bin", tuple(f"data_batch_{i}.bin" for i in range(1, 6)),
                           ("test_batch.bin",), 1, 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": CifarFormat("CIFAR-100", "cifar-100-binary", ("train.bin",), ("test.bin",), 2, 100,
                            (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


def _cifar_dir(data: DataSettings, fmt: CifarFormat) -> Path:
    root = _existing_dir(data)
    for candidate in (root, root / fmt.folder):
        if (candidate / fmt.train_files[0]).is_file():
            return candidate
    return root


def _cifar_files(data: DataSettings, fmt: CifarFormat) -> tuple[list[Path], list[Path]]:
    """The train and eval files, each present and a whole number of records long."""
    directory = _cifar_dir(data, fmt)
    expected = ", ".join(fmt.train_files + fmt.eval_files)
    out: tuple[list[Path], list[Path]] = ([], [])
    for names, paths in ((fmt.train_files, out[0]), (fmt.eval_files, out[1])):
        for name in names:
            path = directory / name
            if not path.is_file():
                raise UsageError(f"--data_dir {data.data_dir}: {name} not found in {directory}; {fmt.title} binary "
                                 f"needs {expected} (the extracted 'binary version' archive)")
            size = path.stat().st_size
            if size == 0 or size % fmt.record_bytes:
                raise UsageError(f"--data_dir {data.data_dir}: {path} has {size} bytes, not a whole number of "
                                 f"{fmt.record_bytes}-byte {fmt.title} records; use the binary version of the "
                                 "dataset (not the python or matlab one)")
            paths.append(path)
    return out


class CifarBinary(Dataset):
    """Records of label byte(s) + 3072 pixel bytes (1024 red, 1024 green, 1024 blue, row-major 32x32).

    Files are memory-mapped: ranks and loader workers share the page cache instead of copying the data.
    """

    def __init__(self, files: list[Path], fmt: CifarFormat, augment: bool, flag_hint: str):
        self.fmt = fmt
        self.transform = ImageTransform(fmt.mean, fmt.std, augment)
        self._records = [np.memmap(path, dtype=np.uint8, mode="r").reshape(-1, fmt.record_bytes) for path in files]
        self._starts = np.cumsum([0] + [len(r) for r in self._records]).tolist()
        labels = [np.asarray(r[:, fmt.label_bytes - 1], dtype=np.int64) for r in self._records]
        for path, part in zip(files, labels):
            bad = np.flatnonzero(part >= fmt.num_classes)
            if bad.size:
                raise UsageError(f"{flag_hint}: {path} record {bad[0]} has label {part[bad[0]]}, but {fmt.title} has "
                                 f"{fmt.num_classes} classes; the file is not {fmt.title} binary (or is corrupted)")
        self.targets = np.concatenate(labels)

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        part = bisect.bisect_right(self._starts, index) - 1
        record = self._records[part][index - self._starts[part]]
        pixels = torch.from_numpy(np.array(record[self.fmt.label_bytes:])).view(3, 32, 32)
        return self.transform(pixels), int(self.targets[index])


def _check_cifar(data: DataSettings) -> None:
    fmt = CIFAR[data.dataset]
    _require_flag(data, "num_classes", fmt.num_classes, f"{fmt.title} has {fmt.num_classes} classes")
    _require_flag(data, "in_channels", 3, f"{fmt.title} images are RGB")
    _require_flag(data, "image_size", 32, f"{fmt.title} images are 32x32")
    _cifar_files(data, fmt)


def _build_cifar(data: DataSettings) -> tuple[Dataset, Dataset]:
    fmt = CIFAR[data.dataset]
    train_files, eval_files = _cifar_files(data, fmt)
    hint = f"--data_dir {data.data_dir}"
    return CifarBinary(train_files, fmt, True, hint), CifarBinary(eval_files, fmt, False, hint)


# --- ImageFolder ---------------------------------------------------------------------------------

EVAL_FOLDERS = ("val", "test")


def _class_names(split_dir: Path) -> list[str]:
    return sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


def _image_folder_dirs(data: DataSettings) -> tuple[Path, Path | None, list[str]]:
    root = _existing_dir(data)
    train_dir = root / "train"
    if not train_dir.is_dir():
        raise UsageError(f"--data_dir {data.data_dir}: no train/ folder; an imagefolder dataset is "
                         "DIR/train/<class>/<image> (and optionally DIR/val/<class>/<image>)")
    classes = _class_names(train_dir)
    if len(classes) < 2:
        raise UsageError(f"--data_dir {data.data_dir}: {train_dir} has {len(classes)} class folder(s); make one "
                         "folder per class (at least 2) holding that class's images")
    eval_dir = next((root / name for name in EVAL_FOLDERS if (root / name).is_dir()), None)
    return train_dir, eval_dir, classes


def _check_image_folder(data: DataSettings) -> None:
    _require_pillow()
    _, _, classes = _image_folder_dirs(data)
    _require_flag(data, "num_classes", len(classes), f"{data.data_dir}/train has {len(classes)} class folders")
    if data.in_channels not in (1, 3):
        raise UsageError(f"--in_channels {data.in_channels}: imagefolder reads images as RGB (3) or grayscale (1); "
                         "pass --in_channels 3 or 1")


def _scan(split_dir: Path, class_index: dict[str, int], flag_hint: str) -> list[tuple[Path, int]]:
    """(path, label) of every image, in sorted order so that every rank sees the same indices."""
    samples = []
    for name in _class_names(split_dir):
        if name not in class_index:
            raise UsageError(f"{flag_hint}: {split_dir / name} is not a class of train/ "
                             f"({', '.join(sorted(class_index))}); rename or remove it")
        files = sorted(p for p in (split_dir / name).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        if not files:
            raise UsageError(f"{flag_hint}: class folder {split_dir / name} has no images "
                             f"({', '.join(IMAGE_SUFFIXES)})")
        samples += [(path, class_index[name]) for path in files]
    return samples


class ImageFolder(Dataset):
    """Images decoded with Pillow, shorter side resized to `image_size`, centre-cropped square."""

    def __init__(self, samples: list[tuple[Path, int]], classes: list[str], image_size: int, channels: int,
                 augment: bool):
        self.samples, self.classes = samples, classes
        self.image_size, self.channels = image_size, channels
        mean, std = (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else (GRAY_MEAN, GRAY_STD)
        self.transform = ImageTransform(mean, std, augment)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path, label = self.samples[index]
        try:
            with Image.open(path) as img:
                img = _resize_center_crop(img.convert("RGB" if self.channels == 3 else "L"), self.image_size)
        except (OSError, ValueError) as exc:  # PIL.UnidentifiedImageError is an OSError
            raise ValueError(f"{path}: not a readable image ({exc}); fix or remove the file") from None
        array = np.asarray(img, dtype=np.uint8).reshape(self.image_size, self.image_size, self.channels)
        return self.transform(torch.from_numpy(array.copy()).permute(2, 0, 1)), label


def _resize_center_crop(img, size: int):
    from PIL import Image

    width, height = img.size
    if (width, height) == (size, size):
        return img
    scale = size / min(width, height)
    new_w, new_h = max(size, round(width * scale)), max(size, round(height * scale))
    img = img.resize((new_w, new_h), Image.Resampling.BILINEAR)
    left, top = (new_w - size) // 2, (new_h - size) // 2
    return img.crop((left, top, left + size, top + size))


def _build_image_folder(data: DataSettings) -> tuple[Dataset, Dataset | None]:
    train_dir, eval_dir, classes = _image_folder_dirs(data)
    index = {name: i for i, name in enumerate(classes)}
    hint = f"--data_dir {data.data_dir}"
    shape = dict(classes=classes, image_size=data.image_size, channels=data.in_channels)
    train = ImageFolder(_scan(train_dir, index, hint), augment=True, **shape)
    held_out = ImageFolder(_scan(eval_dir, index, hint), augment=False, **shape) if eval_dir else None
    return train, held_out


def _require_pillow() -> None:
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise UsageError("--dataset imagefolder needs Pillow: pip install 'ddptrain[images]'") from None


# --- scikit-learn's digits -----------------------------------------------------------------------

DIGITS_EVAL_EVERY = 5  # of each class's samples, in file order, every 5th is held out


class TensorImages(Dataset):
    """Ready-made image tensors (no augmentation)."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor):
        self.images, self.targets = images, targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.targets[index])


def _require_sklearn() -> None:
    try:
        import sklearn.datasets  # noqa: F401
    except ImportError:
        raise UsageError("--dataset digits needs scikit-learn: pip install 'ddptrain[digits]'") from None


def _check_digits(data: DataSettings) -> None:
    _require_sklearn()
    _require_flag(data, "num_classes", 10, "digits has 10 classes")
    _require_flag(data, "in_channels", 1, "digits images are grayscale")
    _require_flag(data, "image_size", 8, "digits images are 8x8")


def digits_split(targets: np.ndarray) -> np.ndarray:
    """Boolean mask of eval samples: every DIGITS_EVAL_EVERY-th sample of each class (stratified, fixed)."""
    is_eval = np.zeros(len(targets), dtype=bool)
    for label in np.unique(targets):
        members = np.flatnonzero(targets == label)
        is_eval[members[::DIGITS_EVAL_EVERY]] = True
    return is_eval


def _build_digits(data: DataSettings) -> tuple[Dataset, Dataset]:
    from sklearn.datasets import load_digits

    digits = load_digits()  # 1797 images of 8x8 grey levels 0..16, shipped inside scikit-learn
    images = torch.from_numpy(digits.images.astype(np.float32) / 16.0).unsqueeze(1)
    targets = torch.from_numpy(digits.target.astype(np.int64))
    is_eval = torch.from_numpy(digits_split(digits.target))
    train_images = images[~is_eval]
    images = (images - train_images.mean()) / train_images.std()  # statistics of the train split only
    return (TensorImages(images[~is_eval].contiguous(), targets[~is_eval]),
            TensorImages(images[is_eval].contiguous(), targets[is_eval]))


# --- entry points --------------------------------------------------------------------------------

def _existing_dir(data: DataSettings) -> Path:
    root = Path(data.data_dir)
    if not root.is_dir():
        raise UsageError(f"--data_dir {data.data_dir}: no such directory; pass the directory that holds the "
                         f"{data.dataset} files")
    return root


def _require_flag(data: DataSettings, name: str, wanted: int, why: str) -> None:
    if getattr(data, name) != wanted:
        raise UsageError(f"--{name} {getattr(data, name)} does not fit --dataset {data.dataset}: {why}; "
                         f"pass --{name} {wanted}")


_CHECKS = {"cifar10": _check_cifar, "cifar100": _check_cifar, "imagefolder": _check_image_folder,
           "digits": _check_digits}
_BUILDERS = {"cifar10": _build_cifar, "cifar100": _build_cifar, "imagefolder": _build_image_folder,
             "digits": _build_digits}


def check(data: DataSettings) -> None:
    """Cheap checks of a file-based dataset against the config; UsageError naming the flag and fix."""
    _CHECKS[data.dataset](data)


def build(data: DataSettings) -> tuple[Dataset, Dataset | None]:
    """(train, eval or None) for a built-in file-based `--dataset`."""
    if data.dataset not in _BUILDERS:
        raise UsageError(f"--dataset {data.dataset!r}: not a file-based dataset ({', '.join(_BUILDERS)})")
    check(data)
    return _BUILDERS[data.dataset](data)
