"""Models: the built-in ones, built from the [data] section, and Hugging Face models (`hf`: `--model hf:...` and
the tokenized `--dataset hf:...` they train on). A 'pkg.mod:fn' plug-in is called with the whole config, by
`loop.plugins`.

`ddptrain.models` is public: a plug-in may use its builders and `eval_mode`.

May import: the contracts at the top (config, errors). Nothing else in ddptrain.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
from torch import nn

from ddptrain.config import DataSettings, FinetuneSettings
from ddptrain.errors import UsageError
from ddptrain.models import hf, lora, meta


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        return nn.GroupNorm(min(32, channels // 4) or 1, channels)
    return nn.Identity()


class BasicBlock(nn.Module):
    """Two 3x3 convs with a residual connection; a 1x1 projection when shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int, norm: str):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=norm == "none")
        self.norm1 = _norm(norm, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=norm == "none")
        self.norm2 = _norm(norm, c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=norm == "none"),
                                          _norm(norm, c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class MiniResNet(nn.Module):
    """The seed article's model: a 3x3 stem, 3 stages x 2 residual blocks (64/128/256), pool, linear."""

    fsdp_blocks = (BasicBlock,)  # what --strategy fsdp shards (and gathers) as one unit

    def __init__(self, in_channels: int = 3, num_classes: int = 10, width: int = 64, norm: str = "batch"):
        super().__init__()
        widths = (width, 2 * width, 4 * width)
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1, bias=norm == "none"),
                                  _norm(norm, width), nn.ReLU(inplace=True))
        layers, c_in = [], width
        for stage, c_out in enumerate(widths):
            for block in range(2):
                layers.append(BasicBlock(c_in, c_out, stride=2 if stage > 0 and block == 0 else 1, norm=norm))
                c_in = c_out
        self.stages = nn.Sequential(*layers)
        self.head = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class MLP(nn.Module):
    """A small BatchNorm-free classifier: flatten, one hidden layer. Fast, and exact across world sizes."""

    fsdp_blocks = (nn.Linear,)

    def __init__(self, in_features: int, num_classes: int, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(),
                                 nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """`keep`: (batch, 1, length, length) which keys each query may attend to; None = causal. Under tensor
        parallel `qkv` gives this rank's heads of q, k and v (GPT.tp_plan), so the heads are counted from it."""
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=2)
        heads = lambda t: t.view(batch, length, -1, width // self.num_heads).transpose(1, 2)  # noqa: E731
        attended = nn.functional.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=keep,
                                                              is_causal=keep is None)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, -1))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """A small GPT-style decoder: token + learned position embeddings, pre-norm causal blocks, a final norm,
    and an output layer tied to the token embedding. `forward(tokens)` -> (batch, length, vocab) logits."""

    fsdp_blocks = (Block,)  # the tied embedding/output matrix: split by vocabulary rows, or in the root unit
    # --tp: how each block's layers split over a tensor-parallel group (parallel/tensor.py; transformers'
    # `base_model_tp_plan` spelling). qkv is three projections in one: each rank keeps its heads of each.
    # The rest (embeddings, norms, the tied head) is whole on every rank of the group.
    tp_plan = {"blocks.*.qkv": "colwise_fused3", "blocks.*.proj": "rowwise",
               "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}

    def __init__(self, vocab_size: int, seq_len: int, width: int, num_layers: int, num_heads: int):
        super().__init__()
        self.seq_len = seq_len
        self.embed = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(Block(width, num_heads) for _ in range(num_layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied: one matrix reads and writes tokens
        for name, param in self.named_parameters():
            if param.dim() == 2:
                nn.init.normal_(param, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(param)

    def get_input_embeddings(self) -> nn.Embedding:  # transformers' names: parallel/vocab.py finds them so
        return self.embed

    def get_output_embeddings(self) -> nn.Linear:
        return self.head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(batch, length) token ids -> (batch, length, vocab) logits. `attention_mask` (1 = token, 0 = padding)
        keeps padding out of the attention; right padding needs none (a causal model never looks ahead).
        `position_ids` (batch, length), a packed row's (data/packing.py): each position's place in its document,
        0 where one starts; a query then sees the earlier tokens of its own document only."""
        length = input_ids.shape[1]
        if length > self.seq_len:
            raise ValueError(f"sequence of {length} tokens is longer than the model's context of {self.seq_len}")
        if position_ids is None:
            x = self.embed(input_ids) + self.position(torch.arange(length, device=input_ids.device))
        else:
            x = self.embed(input_ids) + self.position(position_ids)
        keep = None
        if position_ids is not None:
            document = (position_ids == 0).cumsum(dim=1)
            causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
            keep = (causal & (document[:, :, None] == document[:, None, :]))[:, None]
        elif attention_mask is not None:
            causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
            # A query sees the earlier positions that are tokens, and always itself (a padded query's output
            # is never counted; attending to nothing would make it NaN).
            keep = (causal & attention_mask.bool()[:, None, None, :]) | torch.eye(length, dtype=torch.bool,
                                                                                device=input_ids.device)
        for block in self.blocks:
            x = block(x, keep)
        return self.head(self.norm(x))


BUILT_IN = ("mini_resnet", "mlp", "gpt")


def meta_buildable(data: DataSettings, *, sharded: bool, channels_last: bool) -> bool:
    """Whether `--model` is built on the meta device: `sharded` (fsdp/hsdp), a built-in or a transformers model
    from a local directory (a config.json, or safetensors weights), whose init or weights parallel/materialize.py
    fills shard by shard, LoRA's adapters included. The rest (plug-ins, hub names, .bin weights, SyncBatchNorm,
    channels_last) is built whole on every rank, then sharded."""
    if not sharded or data.sync_batchnorm or channels_last:
        return False
    if data.model.startswith("hf:"):
        return hf.local_source(data) is not None
    return data.model in BUILT_IN


def build_model(data: DataSettings, on_meta: bool = False) -> nn.Module:
    """The built-in or transformers model `--model` names. Call with the same seed on every rank (DDP also
    broadcasts rank 0's). `on_meta` (under `torch.device("meta")`): a transformers model from its config alone,
    weights unread."""
    if data.model.startswith("hf:"):
        return hf.build_model(data, on_meta)
    if data.model == "mini_resnet":
        return MiniResNet(data.in_channels, data.num_classes, data.width, data.norm)
    if data.model == "mlp":
        return MLP(data.in_channels * data.image_size ** 2, data.num_classes, hidden=data.width)
    if data.model == "gpt":
        return GPT(data.vocab_size, data.seq_len, data.width, data.num_layers, data.num_heads)
    raise UsageError(f"--model {data.model!r}: not a built-in ({', '.join(BUILT_IN)}); build a 'pkg.mod:fn' "
                     "plug-in with ddptrain.loop.plugins.model_of(cfg)")


def instantiate(data: DataSettings, finetune: FinetuneSettings, model: nn.Module | Callable[[], nn.Module] | None,
                device: torch.device, *, seed: int, sharded: bool, channels_last: bool) -> nn.Module:
    """The run's module on `device`: `model` itself, what `model()` builds (`loop.plugins.model_maker`), or
    `--model`'s built-in, built after seeding with `seed` so that init is identical on every rank; SyncBatchNorm
    and channels_last as asked; then LoRA's adapters (--lora_rank), whose init draws next from the same seeded
    RNG."""
    torch.manual_seed(seed)
    adapt = functools.partial(lora.apply, finetune=finetune, model=data.model) if finetune.lora_rank else None
    if model is None and meta_buildable(data, sharded=sharded, channels_last=channels_last):
        # Sharded: no tensor of it is allocated until each rank fills its own shards after fully_shard
        # (parallel/materialize.py replays this seeded init there, per module).
        built = meta.build(lambda: build_model(data, on_meta=True), adapt, transformers=data.model.startswith("hf:"))
        if built is not None:
            return built
        torch.manual_seed(seed)
    if model is None:
        model = build_model(data)
    elif not isinstance(model, nn.Module):
        model = model()
    module = model.to(device)
    if data.sync_batchnorm:
        module = nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if channels_last:
        module = module.to(memory_format=torch.channels_last)
    return adapt(module) if adapt is not None else module


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """`module` in eval mode for the block, then every submodule back in its own mode: one a user froze with
    `.eval()` (a frozen BatchNorm, a teacher) stays frozen, where `module.train()` would switch it back."""
    modes = [(sub, sub.training) for sub in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for sub, training in modes:
            sub.training = training
