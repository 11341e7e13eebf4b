"""A small residual convolutional network with BatchNorm and a cross-entropy loss: an image
classifier, the kind of model that is not a transformer.

A stem ``Conv2d -> BatchNorm2d -> ReLU -> MaxPool2d``, then residual blocks of two 3x3
convolutions with BatchNorm (each stage after the first halves the image and doubles the
channels), global average pooling and a linear head. In training, BatchNorm normalizes by the
statistics of the whole batch and updates its running statistics: autopar runs it on the whole
batch (as one process does) and plans no pipeline stages or microbatches for it.

Example::

    model = build(width=16, blocks=2)
    loss = model(*model.example_inputs(8))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, channels_in: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(channels_in, channels, 1, stride=stride, bias=False), nn.BatchNorm2d(channels))
            if stride != 1 or channels_in != channels
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """``forward(images [batch, 3, size, size], labels [batch]) -> cross-entropy``."""

    def __init__(self, *, width: int, blocks: int, stages: int, classes: int, image: int) -> None:
        super().__init__()
        self.image, self.classes = image, classes
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2)
        )
        layers, channels = [], width
        for stage in range(stages):
            for b in range(blocks):
                layers.append(Block(channels, width * 2**stage, 2 if stage and not b else 1))
                channels = width * 2**stage
        self.blocks = nn.Sequential(*layers)
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        features = F.adaptive_avg_pool2d(self.blocks(self.stem(images)), 1).flatten(1)
        return F.cross_entropy(self.head(features), labels)

    def example_inputs(self, batch_size: int, device=None) -> tuple[torch.Tensor, ...]:
        """A global batch ``(images, labels)``, deterministic (seed 0); ``device`` defaults to the model's."""
        device = torch.device(device) if device is not None else next(self.parameters()).device
        shape = (batch_size, 3, self.image, self.image)
        if device.type == "meta":
            return torch.empty(shape, device=device), torch.empty(batch_size, dtype=torch.long, device=device)
        generator = torch.Generator().manual_seed(0)
        images = torch.randn(shape, generator=generator)
        labels = torch.randint(0, self.classes, (batch_size,), generator=generator)
        return images.to(device), labels.to(device)


def build(*, width: int = 16, blocks: int = 2, stages: int = 2, classes: int = 10, image: int = 16) -> ResNet:
    """Build the network; module names are ``stem.N``, ``blocks.N.conv1`` ... and ``head``.

    Example::

        with torch.device("meta"):
            model = build(width=64, blocks=2, stages=4, classes=1000, image=224)   # ResNet-18's shapes
    """
    if min(width, blocks, stages, classes, image) < 1:
        raise ValueError(f"sizes must be positive, got {width=}, {blocks=}, {stages=}, {classes=}, {image=}")
    return ResNet(width=width, blocks=blocks, stages=stages, classes=classes, image=image)
