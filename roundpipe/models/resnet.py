"""A ResNet-18-shaped CNN as a list of layers, and CIFAR-shaped data that needs no download.

    layers = resnet18_layers(num_classes=10, width=64)   # stem, 8 basic blocks, head
    x, y = synthetic_cifar(256, seed=0)                   # [256, 3, 32, 32], labels in 0..9

The layers are what RoundPipe cuts into stages: the stem (3x3 convolution, BatchNorm, ReLU),
each of the 8 basic blocks of ResNet-18 (two 3x3 convolutions with BatchNorm and a shortcut,
strided with a 1x1 projection where the width doubles), and the head (global average pool and a
linear classifier).  `width` scales every channel count (64 is ResNet-18's).

The data: each class is a fixed random low-frequency colour pattern, and a sample is its class's
pattern plus noise, so a model can learn it within a few steps (examples/cnn_quickstart.py).
"""
from __future__ import annotations

import torch
from torch import nn

from roundpipe.core.checks import is_int


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class Head(nn.Module):
    def __init__(self, cin: int, num_classes: int):
        super().__init__()
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


def resnet18_layers(num_classes: int = 10, width: int = 64, seed: int = 0) -> list[nn.Module]:
    """ResNet-18 for 32x32 inputs as 10 layers (stem, 8 blocks, head), initialised from `seed`
    (the caller's RNG state is left as it was)."""
    for name, v in (("num_classes", num_classes), ("width", width)):
        if not is_int(v) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                                 nn.BatchNorm2d(width), nn.ReLU())]
        cin = width
        for k, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
            for j in range(2):
                stride = 2 if k > 0 and j == 0 else 1
                layers.append(BasicBlock(cin, cout, stride))
                cin = cout
        layers.append(Head(cin, num_classes))
    return layers


def synthetic_cifar(n: int, num_classes: int = 10, seed: int = 0, noise: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """n CIFAR-shaped images [n, 3, 32, 32] and their labels: class patterns plus noise."""
    if not is_int(n) or n < 1:
        raise ValueError(f"n={n!r} must be an int >= 1")
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(num_classes, 3, 4, 4, generator=torch.Generator().manual_seed(12345))
    patterns = torch.nn.functional.interpolate(coarse, size=(32, 32), mode="bilinear", align_corners=False)
    y = torch.randint(0, num_classes, (n,), generator=g)
    x = patterns[y] + noise * torch.randn(n, 3, 32, 32, generator=g)
    return x, y
