"""The torch models lifl knows by name: those ``lifl demo`` and the benchmarks train
(``lifl.workload``), and the architectures a job may name so that queries run inference on its
models (``lifl.flstore.workloads``). All take the digits' 1 x 8 x 8 images and give 10 classes;
torch is imported only to build one.
"""

from __future__ import annotations

from typing import Any

MODELS = ("cnn", "resnet18", "resnet34", "resnet152")


def make_model(name: str, seed: int = 0) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
        )
    if name in MODELS:
        import torchvision

        class Gray3(nn.Module):
            """ResNets take three channels: repeat the digits' one."""

            def forward(self, x: Any) -> Any:
                return x.expand(-1, 3, -1, -1)

        return nn.Sequential(Gray3(), getattr(torchvision.models, name)(weights=None, num_classes=10))
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
