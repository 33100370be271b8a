"""Image models (ResNet-20, the cuda-convnet ConvNet32), build_model shapes, and user factories."""

import importlib
import sys
import textwrap

import pytest
import torch
from torch import nn

from cloudburst.models import (
    MODEL_NAMES,
    ConvNet32,
    ModelError,
    ResNet20,
    build_model,
    check_model,
    is_factory_spec,
    resolve_factory,
)
from tests.support import same_state


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def same_params(a: nn.Module, b: nn.Module) -> bool:
    return same_state(a.state_dict(), b.state_dict())


# ResNet-20 by hand (3x3 convs without bias; each BN has weight and bias):
#   stem   conv 3*16*9 = 432,        BN 2*16 = 32                                    ->     464
#   stage1 3 blocks x (2 convs 16*16*9 = 2*2304, 2 BN 2*32 = 64)    = 3 * 4672       ->  14,016
#   stage2 first (16*32*9 + 32*32*9 = 13,824, BN 128)  = 13,952
#          two more x (2*9216 + 128 = 18,560)          = 37,120                      ->  51,072
#   stage3 first (32*64*9 + 64*64*9 = 55,296, BN 256)  = 55,552
#          two more x (2*36,864 + 256 = 73,984)        = 147,968                     -> 203,520
#   linear 64*10 + 10                                                                ->     650
#   total                                                                               269,722
RESNET20_PARAMS = 269_722
# ConvNet32 on 3x32x32: conv1 3*64*25 + 64 = 4,864; conv2 64*64*25 + 64 = 102,464;
# pools 32 -> 16 -> 8, fc1 64*8*8*384 + 384 = 1,573,248; fc2 384*192 + 192 = 73,920;
# linear 192*10 + 10 = 1,930; total 1,756,426.
CONVNET32_PARAMS = 1_756_426


def test_resnet20_shapes_parameter_count_and_gradients():
    assert ResNet20()(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert n_params(ResNet20()) == RESNET20_PARAMS
    # one input channel: only the stem conv shrinks, by 2 * 16 * 9
    assert n_params(ResNet20(in_channels=1)) == RESNET20_PARAMS - 2 * 16 * 9
    model = ResNet20(in_channels=1, num_classes=7)
    model(torch.randn(2, 1, 32, 32)).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    # global average pooling: any H, W >= 8, odd or not square
    assert model(torch.randn(2, 1, 9, 12)).shape == (2, 7)


def test_resnet20_option_a_shortcut_is_parameter_free():
    model = ResNet20()
    for stage, (c_in, c_out) in ((model.stage2, (16, 32)), (model.stage3, (32, 64))):
        shortcut = stage[0].shortcut
        assert list(shortcut.parameters()) == [] and list(shortcut.buffers()) == []
        x = torch.randn(2, c_in, 8, 8)
        y = shortcut(x)
        assert y.shape == (2, c_out, 4, 4)
        assert torch.equal(y[:, :c_in], x[:, :, ::2, ::2])
        assert torch.count_nonzero(y[:, c_in:]) == 0
    assert isinstance(model.stage1[0].shortcut, nn.Identity)


def tf_lrn_by_hand(a: torch.Tensor, alpha: float = 0.001 / 9, radius: int = 4) -> torch.Tensor:
    """tf.nn.lrn: b_c = a_c / (1 + alpha * sum_{|c'-c| <= radius} a_c'^2)^0.75, by loops."""
    out = torch.empty_like(a)
    channels = a.shape[1]
    for c in range(channels):
        window = a[:, max(0, c - radius) : min(channels, c + radius + 1)]
        out[:, c] = a[:, c] / (1.0 + alpha * (window**2).sum(1)) ** 0.75
    return out


def test_convnet32_shape_parameter_count_and_tensorflow_lrn():
    model = ConvNet32()
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert n_params(model) == CONVNET32_PARAMS
    small = ConvNet32(in_channels=1, num_classes=5, image_size=24)
    assert small(torch.randn(2, 1, 24, 24)).shape == (2, 5)
    # its LRN is TensorFlow's: scale 30 makes alpha * sum(a^2) ~ 1, so a wrong alpha
    # convention cannot pass
    torch.manual_seed(0)
    a = 30 * torch.randn(2, 12, 3, 3, dtype=torch.float64)
    expected = tf_lrn_by_hand(a)
    for lrn in (model.norm1, model.norm2):
        torch.testing.assert_close(lrn(a), expected)
    # torch's alpha taken as TF's alpha (forgetting torch divides it by size) is far off
    naive = nn.LocalResponseNorm(9, alpha=0.001 / 9, beta=0.75, k=1.0)
    assert not torch.allclose(naive(a), expected, rtol=1e-2)


FITTING = [("mlp", (40,)), ("cnn", (40,)), ("mlp", (1, 8, 8)), ("resnet20", (3, 32, 32))]
FITTING += [("resnet20", (1, 28, 28)), ("convnet", (3, 32, 32))]


@pytest.mark.parametrize("name, shape", FITTING)
def test_build_model_same_seed_same_parameters_and_check_model_accepts_it(name, shape):
    assert set(MODEL_NAMES) == {n for n, _ in FITTING}  # every built-in is tested here
    check_model(name, shape, 10)
    a, b = build_model(name, shape, 10, seed=5), build_model(name, shape, 10, seed=5)
    assert same_params(a, b)
    assert not same_params(a, build_model(name, shape, 10, seed=6))
    assert a(torch.randn(2, *shape)).shape == (2, 10)
    if shape == (40,):  # an int or a list names the same 1-D shape
        assert same_params(a, build_model(name, 40, 10, seed=5))
        assert same_params(a, build_model(name, [40], 10, seed=5))


@pytest.mark.parametrize(
    "name, shape, words",
    [
        ("cnn", (3, 32, 32), ["'cnn'", "1-D", "(3, 32, 32)", "resnet20"]),
        ("resnet20", (40,), ["'resnet20'", "(40,)", "channels, height, width"]),
        ("convnet", 40, ["'convnet'", "(40,)"]),
        ("convnet", (3, 32, 24), ["square", "32", "24"]),
        ("mlp", (), ["input_shape"]),
        ("mlp", (3, 0), ["input_shape", "(3, 0)"]),
        ("transformer", (40,), ["'transformer'", "mlp, cnn, resnet20, convnet", ":function"]),
    ],
)
def test_build_model_and_check_model_reject_bad_shapes_and_names(name, shape, words):
    for call in (check_model, lambda *a: build_model(*a, seed=0)):
        with pytest.raises(ModelError) as info:
            call(name, shape, 10)
        message = str(info.value)
        assert "\n" not in message and all(w in message for w in words), message
    assert issubclass(ModelError, ValueError)


FACTORY_MODULE = """
import torch
from torch import nn

calls = []

def classes_and_channels(num_classes, in_channels):
    calls.append(("classes_and_channels", num_classes, in_channels))
    return nn.Sequential(
        nn.Conv2d(in_channels, 4, 3),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, num_classes)
    )

def everything(**kwargs):
    calls.append(("everything", kwargs))
    return nn.Linear(4, kwargs["num_classes"])

def nothing():
    calls.append(("nothing",))
    return nn.Linear(4, 2)

def with_default(num_classes, hidden=7):
    return nn.Linear(hidden, num_classes)

def needs_channels(in_channels):
    return nn.Linear(in_channels, 2)

def not_a_module():
    return "resnet"

def empty_module():
    return nn.ReLU()

not_callable = 42
"""


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "cb_test_factories.py").write_text(textwrap.dedent(FACTORY_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("cb_test_factories", None)
    yield importlib.import_module("cb_test_factories")
    sys.modules.pop("cb_test_factories", None)


def test_factory_gets_only_the_keywords_it_accepts_after_seeding(factories):
    model = build_model("cb_test_factories:classes_and_channels", (1, 8, 8), 3, seed=0)
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 3)
    build_model("cb_test_factories:everything", (3, 32, 32), 5, seed=0)
    build_model("cb_test_factories:everything", (40,), 5, seed=0)
    build_model("cb_test_factories:nothing", (40,), 5, seed=0)
    assert factories.calls == [
        ("classes_and_channels", 3, 1),
        ("everything", {"num_classes": 5, "input_shape": (3, 32, 32), "in_channels": 3}),
        ("everything", {"num_classes": 5, "input_shape": (40,)}),  # no in_channels for 1-D
        ("nothing",),
    ]
    assert build_model("cb_test_factories:with_default", 40, 5, seed=0).in_features == 7
    assert resolve_factory("cb_test_factories:nothing") is factories.nothing
    assert resolve_factory("torch.nn:Linear") is nn.Linear
    # the factory is called after seeding
    a = build_model("cb_test_factories:nothing", 40, 2, seed=11)
    b = build_model("cb_test_factories:nothing", 40, 2, seed=11)
    assert same_params(a, b)
    torch.manual_seed(11)
    assert torch.equal(a.weight, nn.Linear(4, 2).weight)


def test_factory_spec_syntax():
    for good in ("pkg.mod:fn", "m:f", "a.b.c:Make_Model2"):
        assert is_factory_spec(good)
    for bad in ("foo", "a.b:", ":f", "a..b:f", "a.b:f.g", "1a:f", "a:f:g", "class:f", "a b:f", ""):
        assert not is_factory_spec(bad)
    assert not any(is_factory_spec(name) for name in MODEL_NAMES)


@pytest.mark.parametrize(
    "spec, words, preflight_refuses",
    [
        ("foo", ["package.module:function"], True),
        ("a.b:", ["package.module:function"], True),
        (":f", ["package.module:function"], True),
        ("cb_no_such_module_xyz:f", ["cannot import", "cb_no_such_module_xyz"], True),
        ("cb_test_factories:missing", ["has no", "'missing'"], True),
        ("cb_test_factories:not_callable", ["not callable", "int"], True),
        ("cb_test_factories:not_a_module", ["str", "not a torch.nn.Module"], False),
        ("cb_test_factories:empty_module", ["no parameters"], False),
        ("cb_test_factories:needs_channels", ["requires in_channels", "(40,)"], False),
    ],
)
def test_factory_errors_are_one_line_and_name_the_spec(factories, spec, words, preflight_refuses):
    """A spec that does not resolve is refused by resolving, the preflight and building; a
    factory that builds no usable model passes the preflight (which imports but does not call
    it) and is refused when building."""
    calls = [lambda: build_model(spec, (40,), 10, seed=0)]
    if preflight_refuses:
        calls += [lambda: resolve_factory(spec), lambda: check_model(spec, (40,), 10)]
    else:
        check_model(spec, (40,), 10)
    for call in calls:
        with pytest.raises(ModelError) as info:
            call()
        message = str(info.value)
        assert "\n" not in message and repr(spec) in message, message
        assert all(w in message for w in words), message
