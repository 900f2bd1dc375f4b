"""The built-in models: a small ResNet (has BatchNorm), an MLP (no batch-dependent layers), and
`gpt` for token data (elastic_ddp/workload/gpt.py).

The first two take the images of `elastic_ddp.workload.data.SyntheticImageDataset` (3x16x16, 10
classes). Use the MLP when results must not depend on how a global batch is split over ranks:
BatchNorm statistics are per rank, so MiniResNet's trajectory changes with the world size.
"""

from __future__ import annotations

import torch
from torch import nn

from elastic_ddp.workload.data import IMAGE_SHAPE, NUM_CLASSES
from elastic_ddp.workload.gpt import GPT


class ResidualBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class MiniResNet(nn.Module):
    def __init__(self, num_classes: int = NUM_CLASSES, width: int = 16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(IMAGE_SHAPE[0], width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.layers = nn.Sequential(ResidualBlock(width, width, 1), ResidualBlock(width, 2 * width, 2))
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.layers(self.stem(x))
        return self.head(features.mean(dim=(2, 3)))

    def sharding_blocks(self) -> list[nn.Module]:
        """The units `--sharding fsdp` shards: the stem, each residual block, the head."""
        return [self.stem, *self.layers, self.head]


class MLP(nn.Module):
    def __init__(self, num_classes: int = NUM_CLASSES, hidden: int = 256):
        super().__init__()
        inputs = IMAGE_SHAPE[0] * IMAGE_SHAPE[1] * IMAGE_SHAPE[2]
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(inputs, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def sharding_blocks(self) -> list[nn.Module]:
        """The units `--sharding fsdp` shards: each linear layer."""
        return [module for module in self.net if isinstance(module, nn.Linear)]


def build_model(name: str, seed: int, **sizes: int) -> nn.Module:
    """A built-in model by name, initialised from `seed` (the same weights on every rank); `sizes`:
    the arguments of `gpt.GPT` for `gpt`."""
    builders = {"mini_resnet": MiniResNet, "mlp": MLP, "gpt": GPT}
    if name not in builders:
        raise ValueError(f"--model: got {name!r}; expected one of {', '.join(builders)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return builders[name](**sizes)
