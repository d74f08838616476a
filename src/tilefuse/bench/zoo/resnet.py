"""ResNet-50: torchvision's when it is installed, else this definition of the same network
(bottleneck blocks [3, 4, 6, 3], stride on the 3×3 convolution, BatchNorm, ReLU, a global
average pool and a linear classifier)."""
from __future__ import annotations

import torch
import torch.nn as nn


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, layers=(3, 4, 6, 3), num_classes: int = 1000, width: int = 64):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._stage(width, layers[0])
        self.layer2 = self._stage(width * 2, layers[1], stride=2)
        self.layer3 = self._stage(width * 4, layers[2], stride=2)
        self.layer4 = self._stage(width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * Bottleneck.expansion, num_classes)

    def _stage(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * 4:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes * 4, 1, stride=stride,
                                                 bias=False), nn.BatchNorm2d(planes * 4))
        mods = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * 4
        mods += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*mods)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(width: int = 64, layers=(3, 4, 6, 3)) -> tuple[nn.Module, str]:
    """(model, where it comes from). torchvision's network at the standard width and depth,
    else this file's."""
    if width == 64 and tuple(layers) == (3, 4, 6, 3):
        try:
            from torchvision.models import resnet50 as tv_resnet50

            return tv_resnet50(), "torchvision"
        except Exception:  # not installed, or built for another torch
            pass
    return ResNet(layers, width=width), "tilefuse.bench.zoo.resnet"
