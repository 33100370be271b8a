"""Models: the MNIST-1D networks, two CIFAR-size image networks, and user factories.

- ``mlp``, ``cnn``: the MNIST-1D paper's models (Greydanus 2020). Published test accuracy on
  MNIST-1D: MLP 68%, CNN 94%. Neither has batch norm or dropout, so data-parallel runs can be
  compared exactly with a single-process reference.
- ``resnet20``: He et al. 2016's CIFAR ResNet-20 (0.27 M parameters, batch norm).
- ``convnet``: the cuda-convnet / TensorFlow-tutorial CIFAR-10 network (1.76 M parameters), the
  network family of the GPU A-SGD seed paper, for 32x32 images.
- ``gpt`` / ``gpt:layers=L,width=D,heads=H``: a small decoder-only transformer
  (:mod:`cloudburst.models.gpt`) over byte tokens; its context is the input shape (T,).
- ``package.module:function``: any callable that returns an ``nn.Module``; ``build_model`` passes
  it those of ``num_classes``, ``input_shape`` and ``in_channels`` that it accepts.

Every model error is a ``ModelError`` (a ``ValueError``) with a one-line message.
"""

from __future__ import annotations

import importlib
import inspect
import keyword
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

# ModelError is defined beside the GPT (which models.py imports) so that gpt.py needs nothing
# from this module: no import circle.
from cloudburst.models.gpt import GPT, ModelError, is_gpt_spec, parse_gpt_spec

MODEL_NAMES = ("mlp", "cnn", "resnet20", "convnet")
FACTORY_FORM = "package.module:function"


class MLP(nn.Module):
    def __init__(self, input_length: int = 40, num_classes: int = 10, hidden: int = 100):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(input_length, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class ConvNet1D(nn.Module):
    """The MNIST-1D paper's CNN: three stride-2 convolutions (25 channels) and a linear head."""

    def __init__(self, input_length: int = 40, num_classes: int = 10, channels: int = 25):
        super().__init__()
        self.conv1 = nn.Conv1d(1, channels, 5, stride=2, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        length = input_length
        for k in (5, 3, 3):
            length = (length + 2 - k) // 2 + 1
        self.linear = nn.Linear(channels * length, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(x.shape[0], 1, -1)
        h = self.conv1(h).relu()
        h = self.conv2(h).relu()
        h = self.conv3(h).relu()
        return self.linear(h.flatten(1))


class ZeroPadShortcut(nn.Module):
    """He et al. 2016's option-A shortcut: parameter-free, so ResNet-20 keeps 0.27 M parameters.

    Subsamples space by ``stride`` (``x[:, :, ::2, ::2]``, matching the ceil(H/2) output of the
    stride-2 3x3 convolution with padding 1) and appends zero channels up to ``out_channels``.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.extra_channels = out_channels - in_channels
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, :: self.stride, :: self.stride]
        return F.pad(x, (0, 0, 0, 0, 0, self.extra_channels))


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus shortcut, then ReLU (He et al. 2016, Fig. 2 left)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        if stride == 1 and in_channels == out_channels:
            self.shortcut: nn.Module = nn.Identity()
        else:
            self.shortcut = ZeroPadShortcut(in_channels, out_channels, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn1(self.conv1(x)).relu()
        h = self.bn2(self.conv2(h))
        return (h + self.shortcut(x)).relu()


class ResNet20(nn.Module):
    """He et al. 2016 (Deep Residual Learning, Sec. 4.2): the CIFAR ResNet with n=3 (6n+2 = 20).

    conv3x3 (16) - BN - ReLU, three stages of 3 ``BasicBlock`` with 16, 32, 64 channels (stride 2
    at the start of stages 2 and 3, option-A zero-pad shortcuts), global average pool, linear.
    Works for any H, W >= 8 thanks to the global pool. Convolutions use Kaiming-normal init with
    fan_out (as torchvision's ResNets); BN weight 1, bias 0; the linear layer keeps torch's
    default init. 269,722 parameters for 3 input channels (269,290 + 144 per input channel).
    Has batch norm, so ranks' running statistics differ unless they are synchronised.
    """

    blocks_per_stage = 3

    def __init__(self, in_channels: int = 3, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.stage1 = self._stage(16, 16, stride=1)
        self.stage2 = self._stage(16, 32, stride=2)
        self.stage3 = self._stage(32, 64, stride=2)
        self.linear = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _stage(self, in_channels: int, out_channels: int, stride: int) -> nn.Sequential:
        blocks = [BasicBlock(in_channels, out_channels, stride)]
        blocks += [BasicBlock(out_channels, out_channels) for _ in range(self.blocks_per_stage - 1)]
        return nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x)).relu()
        h = self.stage3(self.stage2(self.stage1(h)))
        return self.linear(h.mean((2, 3)))


# Local response normalisation of the TensorFlow CIFAR-10 tutorial (tf.nn.lrn(x, depth_radius=4,
# bias=1.0, alpha=0.001/9, beta=0.75)): b = a / (bias + alpha_tf * sum_{9 channels} a^2)^beta.
# torch.nn.LocalResponseNorm computes b = a / (k + alpha/size * sum_{size channels} a^2)^beta,
# i.e. it divides alpha by the window size, so alpha_torch = alpha_tf * size = 0.001.
LRN_DEPTH_RADIUS = 4
LRN_SIZE = 2 * LRN_DEPTH_RADIUS + 1
LRN_ALPHA_TF = 0.001 / 9.0
LRN_BIAS = 1.0
LRN_BETA = 0.75


def tf_local_response_norm() -> nn.LocalResponseNorm:
    """``tf.nn.lrn(x, 4, bias=1.0, alpha=0.001 / 9, beta=0.75)`` in torch's convention."""
    return nn.LocalResponseNorm(LRN_SIZE, alpha=LRN_ALPHA_TF * LRN_SIZE, beta=LRN_BETA, k=LRN_BIAS)


class ConvNet32(nn.Module):
    """The cuda-convnet CIFAR-10 network (layers-18pct) as in the TensorFlow CIFAR-10 tutorial.

    The GPU A-SGD seed trained a cuda-convnet network; this is that family scaled to 32x32:
    conv5x5 64 - ReLU - maxpool 3/2 - LRN - conv5x5 64 - ReLU - LRN - maxpool 3/2 - fc 384 -
    ReLU - fc 192 - ReLU - linear. Pools pad 1 so each halves the side (ceil(s/2), as TF's SAME;
    torch pads both sides where TF pads only the end). LRN: see ``tf_local_response_norm``.
    torch's default init; no batch norm or dropout. 1,756,426 parameters for 3x32x32 inputs and
    10 classes (conv 4,864 + 102,464; fc 1,573,248 + 73,920 + 1,930).
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 10, image_size: int = 32):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 5, padding=2)
        self.pool1 = nn.MaxPool2d(3, stride=2, padding=1)
        self.norm1 = tf_local_response_norm()
        self.conv2 = nn.Conv2d(64, 64, 5, padding=2)
        self.norm2 = tf_local_response_norm()
        self.pool2 = nn.MaxPool2d(3, stride=2, padding=1)
        side = image_size
        for _ in range(2):
            side = (side + 2 - 3) // 2 + 1
        self.fc1 = nn.Linear(64 * side * side, 384)
        self.fc2 = nn.Linear(384, 192)
        self.linear = nn.Linear(192, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(self.pool1(self.conv1(x).relu()))
        h = self.pool2(self.norm2(self.conv2(h).relu()))
        h = self.fc2(self.fc1(h.flatten(1)).relu()).relu()
        return self.linear(h)


def is_factory_spec(name: str) -> bool:
    """Whether ``name`` reads as ``dotted.module.path:attr`` (syntax only; imports nothing)."""
    module, sep, attr = name.partition(":")
    return bool(sep) and _is_identifier(attr) and all(map(_is_identifier, module.split(".")))


def _is_identifier(word: str) -> bool:
    return word.isidentifier() and not keyword.iskeyword(word)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def resolve_factory(spec: str) -> Callable[..., object]:
    """Import the module of ``spec`` (``package.module:function``) and return the callable."""
    if not is_factory_spec(spec):
        raise ModelError(
            f"model factory {spec!r} is not of the form {FACTORY_FORM} "
            "(dotted module path, a colon, an attribute name)"
        )
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ModelError(
            f"model factory {spec!r}: cannot import module {module_name!r} ({_one_line(err)}); "
            "is it on PYTHONPATH?"
        ) from err
    if not hasattr(module, attr):
        raise ModelError(f"model factory {spec!r}: module {module_name!r} has no {attr!r}")
    factory = getattr(module, attr)
    if not callable(factory):
        raise ModelError(
            f"model factory {spec!r}: {attr!r} is a {type(factory).__name__}, not callable"
        )
    return factory


def _as_shape(input_shape: int | Sequence[int]) -> tuple[int, ...]:
    shape = (input_shape,) if isinstance(input_shape, int) else tuple(input_shape)
    if not shape or not all(isinstance(d, int) and d >= 1 for d in shape):
        raise ModelError(f"input_shape {shape} must be one or more positive ints")
    return shape


def _check_builtin(name: str, shape: tuple[int, ...]) -> None:
    if name == "cnn" and len(shape) != 1:
        raise ModelError(
            f"model 'cnn' is the 1-D MNIST-1D network and takes 1-D inputs, got shape {shape}; "
            "use resnet20 or convnet for images"
        )
    if name in ("resnet20", "convnet") and len(shape) != 3:
        raise ModelError(
            f"model {name!r} takes (channels, height, width) images, got shape {shape}; "
            "use mlp or cnn for 1-D inputs"
        )
    if name == "convnet" and shape[1] != shape[2]:
        raise ModelError(
            f"model 'convnet' takes square images, got height {shape[1]} and width {shape[2]}; "
            "use resnet20 for non-square images"
        )


def check_model(name: str, input_shape: int | Sequence[int], num_classes: int) -> None:
    """Preflight, before any process starts: raise ``ModelError`` if ``name`` cannot be built.

    A factory spec is imported but not called; a builtin name has its input shape checked.
    """
    shape = _as_shape(input_shape)
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ModelError(f"num_classes {num_classes!r} must be a positive int")
    if is_gpt_spec(name):
        parse_gpt_spec(name)
        if len(shape) != 1:
            raise ModelError(
                f"model 'gpt' takes windows of tokens (a text dataset), got inputs of shape {shape}"
            )
    elif is_factory_spec(name):
        resolve_factory(name)
    elif name in MODEL_NAMES:
        _check_builtin(name, shape)
    else:
        raise ModelError(
            f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}, gpt "
            f"or name a factory as {FACTORY_FORM}"
        )


def _factory_kwargs(
    spec: str, factory: Callable[..., object], shape: tuple[int, ...], num_classes: int
) -> dict[str, object]:
    """Those of num_classes, input_shape, in_channels that ``factory`` accepts by keyword."""
    offered: dict[str, object] = {"num_classes": num_classes, "input_shape": shape}
    if len(shape) == 3:
        offered["in_channels"] = shape[0]
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError) as err:
        raise ModelError(
            f"model factory {spec!r}: cannot read its signature ({_one_line(err)})"
        ) from err
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return offered
    keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    missing = [
        p.name
        for p in params
        if p.default is p.empty
        and p.kind is not p.VAR_POSITIONAL
        and (p.kind not in keyword_kinds or p.name not in offered)
    ]
    if missing:
        raise ModelError(
            f"model factory {spec!r} requires {', '.join(missing)}, but build_model only passes "
            f"{', '.join(offered)} by keyword for input shape {shape}"
        )
    accepted = [p.name for p in params if p.kind in keyword_kinds and p.name in offered]
    return {key: offered[key] for key in accepted}


def build_run_model(cfg: Any, data: Any) -> nn.Module:
    """The model a run's config (a ``RunConfig``) names, for its dataset ``data``, at its
    seed: the one call the driver, the simulator and the pre-flight checks make."""
    return build_model(cfg.model.model, data.input_shape, data.num_classes, cfg.training.seed)


def build_model(
    name: str, input_shape: int | Sequence[int], num_classes: int, seed: int
) -> nn.Module:
    """Build model ``name`` for inputs of ``input_shape`` (without the batch dimension).

    ``input_shape`` is e.g. (40,) for MNIST-1D or (3, 32, 32) for CIFAR; an int n means (n,).
    The same seed gives the same initial θ on every rank (the cold start).
    """
    check_model(name, input_shape, num_classes)
    shape = _as_shape(input_shape)
    if is_factory_spec(name):
        factory = resolve_factory(name)
        kwargs = _factory_kwargs(name, factory, shape, num_classes)
        torch.manual_seed(seed)
        model = factory(**kwargs)
        if not isinstance(model, nn.Module):
            raise ModelError(
                f"model factory {name!r} returned a {type(model).__name__}, not a torch.nn.Module"
            )
        if next(model.parameters(), None) is None:
            raise ModelError(f"model factory {name!r} returned a module with no parameters")
        return model
    torch.manual_seed(seed)
    if is_gpt_spec(name):
        return GPT(vocab=num_classes, context=shape[0], **parse_gpt_spec(name))
    if name == "mlp":
        return MLP(math.prod(shape), num_classes)
    if name == "cnn":
        return ConvNet1D(shape[0], num_classes)
    if name == "resnet20":
        return ResNet20(shape[0], num_classes)
    return ConvNet32(shape[0], num_classes, image_size=shape[1])


@torch.no_grad()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1000
) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on (x, y)."""
    was_training = model.training
    model.eval()
    correct, loss = 0, 0.0
    for i in range(0, x.shape[0], batch):
        logits = model(x[i : i + batch])
        loss += nn.functional.cross_entropy(logits, y[i : i + batch], reduction="sum").item()
        correct += (logits.argmax(1) == y[i : i + batch]).sum().item()
    model.train(was_training)
    return correct / x.shape[0], loss / x.shape[0]
