"""Plexus' built-in `cnn` model (plexus/models.py CNN), the same layers and parameter names, for 28x28 images."""

import torch
from torch import nn


class CNN(nn.Module):
    """Two conv/ReLU/max-pool blocks and a linear head, as plexus.models.CNN."""

    def __init__(self, in_channels: int = 1, image_size: int = 28, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * width * (image_size // 4) ** 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))
