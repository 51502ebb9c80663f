"""CPU-sized backbones for the offline benchmarks.

* :class:`LeNet` -- the Caffe LeNet used by the heated-up paper's MNIST figure (Fig. 2, a
  LeNet whose bottleneck has 2 units).  The bottleneck itself is the embedding head's
  projection (``create_model("lenet", embedding_dim=2)``), so it is configurable.
* :class:`GlyphResNet` -- a compact ResNet (BasicBlocks, BN, ReLU) for
  32x32 grayscale glyph images: ~0.3-1 M parameters, fast enough to train on a laptop CPU.

Both return a feature map [B, C, H, W] and expose ``num_features`` like the big backbones.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from deepmetric.options import int_option

__all__ = ["LeNet", "GlyphResNet", "BasicBlock"]


class LeNet(nn.Module):
    """Caffe LeNet (``examples/mnist/lenet_train_test.prototxt``) up to ``ip1`` + ReLU.

    conv1 5x5x20 -> maxpool 2 -> conv2 5x5x50 -> maxpool 2 -> ip1 (500, ReLU).  As in the
    Caffe model, the convolutions have no activation; ``ip1`` is written as a 4x4 convolution,
    which is exactly the fully connected layer on the 4x4 map of a 28x28 input, so the output
    is a [B, 500, 1, 1] "last conv map" (larger inputs give a larger map, pooled by the head).
    The embedding projection (``ip2`` -> k, the bottleneck) is the head's job.
    """

    def __init__(self, in_chans: int = 1, hidden: int = 500, conv_channels: Sequence[int] = (20, 50)):
        super().__init__()
        hidden = int_option("lenet: hidden", hidden)
        c1, c2 = conv_channels
        self.conv1 = nn.Conv2d(in_chans, c1, 5)
        self.pool1 = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(c1, c2, 5)
        self.pool2 = nn.MaxPool2d(2, 2)
        self.ip1 = nn.Conv2d(c2, hidden, 4)
        self.relu = nn.ReLU(inplace=True)
        self.num_features = hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # 28 -> conv 24 -> pool 12 -> conv 8 -> pool 4 -> ip1 (4x4 kernel) 1: 28 px is the minimum.
        if x.shape[-1] < 28 or x.shape[-2] < 28:
            raise ValueError(f"LeNet needs inputs of at least 28x28 pixels, got {tuple(x.shape)}")
        x = self.pool1(self.conv1(x))
        x = self.pool2(self.conv2(x))
        return self.relu(self.ip1(x))


class BasicBlock(nn.Module):
    """ResNet basic block (He et al., 2016): two 3x3 conv-BN, identity or 1x1 projection shortcut."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class GlyphResNet(nn.Module):
    """Compact ResNet for 32x32 grayscale glyphs.

    stem 3x3 conv (stride 1) -> stages of BasicBlocks; every stage after the first halves the
    resolution.  Defaults ``widths=(16, 32, 64, 128)``, ``depths=(1, 1, 1, 1)``: 0.31 M
    parameters and a 4x4x128 output map for a 32x32 input.  Chosen by timing on 2 CPU cores:
    about 3x the training throughput of widths (32, 64, 128) for the same parameter count,
    because the cheap 16-channel stage carries the 32x32 resolution.
    """

    def __init__(
        self,
        in_chans: int = 1,
        widths: Sequence[int] = (16, 32, 64, 128),
        depths: Sequence[int] = (1, 1, 1, 1),
    ):
        super().__init__()
        if len(widths) != len(depths) or not widths:
            raise ValueError(f"widths {tuple(widths)} and depths {tuple(depths)} must be non-empty and of equal length")
        # a depth of 0 would still build one block (the stage's first), a negative width a
        # tensor torch refuses: every entry is a positive int
        widths = [int_option("glyph_resnet: widths entry", w) for w in widths]
        depths = [int_option("glyph_resnet: depths entry", d) for d in depths]
        self.stem = nn.Sequential(
            nn.Conv2d(in_chans, widths[0], 3, 1, 1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
        )
        stages = []
        cin = widths[0]
        for i, (w, d) in enumerate(zip(widths, depths)):
            blocks = [BasicBlock(cin, w, stride=1 if i == 0 else 2)]
            blocks += [BasicBlock(w, w) for _ in range(d - 1)]
            stages.append(nn.Sequential(*blocks))
            cin = w
        self.stages = nn.Sequential(*stages)
        self.num_features = cin
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        # Zero-init the last BN of each block so every block starts as identity (Goyal et al.,
        # 2017): makes this small net train stably with large learning rates.
        for m in self.modules():
            if isinstance(m, BasicBlock):
                nn.init.zeros_(m.bn2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.stem(x))
