"""Model zoo in training: torchvision-format weights from a local file, the ViT, a Keras 3 convnet under DDP
with resume, user factories through ``_target_``."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers.jobs import assert_ok, compose_cfg, ranks, read_scalars

import ddplab
from ddplab import build
from ddplab.models import VisionTransformer, load_weights, resnet18, resnet50

# A few of torchvision's own key names (torchvision.models.resnet18 / resnet50 state_dicts).
TV_RESNET18 = [
    "conv1.weight",
    "bn1.running_var",
    "layer1.0.conv1.weight",
    "layer2.0.downsample.0.weight",
    "layer2.0.downsample.1.num_batches_tracked",
    "layer4.1.bn2.bias",
    "fc.weight",
    "fc.bias",
]
TV_RESNET50 = [
    "layer1.0.conv3.weight",
    "layer1.0.bn3.running_mean",
    "layer1.0.downsample.0.weight",
    "layer4.2.conv2.weight",
    "fc.weight",
]


@pytest.mark.parametrize(
    "name,factory,keys", [("resnet18", resnet18, TV_RESNET18), ("resnet50", resnet50, TV_RESNET50)]
)
@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_torchvision_state_dict_loads_before_training(tmp_path, caplog, name, factory, keys):
    """An ImageNet-shaped torchvision state_dict (1000 classes, 7x7 stem) fine-tunes on 10 classes."""
    torch.manual_seed(1)
    tv = factory(num_classes=1000)  # torchvision's architecture and key names
    for p in tv.parameters():
        p.data.normal_()  # unlike any fresh init
    sd = tv.state_dict()
    assert all(k in sd for k in keys)
    path = tmp_path / f"{name}.pth"
    torch.save(sd, path)
    cfg = compose_cfg(
        [f"model={name}", "dataset=synthetic", "dataset.image_size=64", f"model.weights={path}"]
    )
    with caplog.at_level("WARNING", logger="ddplab"):
        model = build.model(cfg)
    got = model.state_dict()
    assert all(torch.equal(got[k], sd[k]) for k in sd if not k.startswith("fc."))
    assert got["fc.weight"].shape == (10, sd["fc.weight"].shape[1])  # the new head keeps its fresh init
    assert "fc.weight kept at its initialisation (file (1000," in caplog.text


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_weights_prefixes_checkpoints_and_wrong_architecture(tmp_path):
    m = resnet18(num_classes=10)
    wrapped = {f"module.{k}": v for k, v in m.state_dict().items()}  # saved from a DDP model
    torch.save(wrapped, tmp_path / "ddp.pth")
    torch.save({"model": m.state_dict(), "epoch": 3}, tmp_path / "ck.pt")  # a ddplab checkpoint
    for f in ("ddp.pth", "ck.pt"):
        fresh = resnet18(num_classes=10)
        assert load_weights(fresh, tmp_path / f) == []
        assert all(torch.equal(fresh.state_dict()[k], m.state_dict()[k]) for k in m.state_dict())
    with pytest.raises(ValueError, match=r"does not fit ResNet: missing: .*layer1\.0\.conv3\.weight"):
        load_weights(resnet50(num_classes=10), tmp_path / "ddp.pth")
    with pytest.raises(FileNotFoundError, match="model.weights=.*no such file.*nothing is downloaded"):
        load_weights(m, tmp_path / "nope.pth")


@pytest.mark.slow
def test_vit_has_torchvision_keys_and_trains(tmp_path):
    with torch.device("meta"):  # names and shapes only: 86M parameters never allocated
        b16 = VisionTransformer(
            image_size=224,
            patch_size=16,
            num_layers=12,
            num_heads=12,
            hidden_dim=768,
            mlp_dim=3072,
            num_classes=1000,
        )
    keys = list(b16.state_dict())
    # torchvision.models.vit_b_16: 152 entries with these names.
    assert len(keys) == 152
    for k in [
        "class_token",
        "conv_proj.weight",
        "encoder.pos_embedding",
        "encoder.layers.encoder_layer_0.self_attention.in_proj_weight",
        "encoder.layers.encoder_layer_11.mlp.3.bias",
        "encoder.ln.weight",
        "heads.head.weight",
    ]:
        assert k in keys
    assert b16.encoder.pos_embedding.shape == (1, 197, 768)
    out = ddplab.run(
        compose_cfg(["model=vit", "num_epochs=5", "progress=none", "optimizer=adamw"], run_dir=tmp_path)
    )
    assert out["val/acc"] > 0.9  # digits (4 patches of 4x4), 5 epochs from scratch: 0.967 measured
    # via Hydra
    with pytest.raises(Exception, match="model.patch_size=3 does not divide dataset.image_size=8"):
        build.model(compose_cfg(["model=vit", "model.patch_size=3"]))


@pytest.mark.dist
@pytest.mark.skipif(
    importlib.util.find_spec("keras") is None, reason="keras not installed (pip install keras)"
)
def test_keras3_convnet_trains_under_ddp_and_resumes(tmp_path):
    """The Keras multi-GPU guide's convnet (Keras 3, torch backend) under ddplab's DDP, 2 ranks."""
    args = ["model=keras_convnet", "num_epochs=3", "progress=none", "run_dir=run"]
    assert_ok(ranks(2, args + ["stop_after_epochs=2"], tmp_path, timeout=240))
    proc = ranks(2, args + ["resume=auto"], tmp_path, timeout=240)
    assert_ok(proc)
    assert "resumed from" in proc.stdout + proc.stderr
    s = read_scalars(tmp_path / "run" / "tb")
    assert [step for step, _ in s["val/acc"]] == [22, 44, 66]
    assert s["val/acc"][-1][1] > 0.9  # 0.955 measured after 3 epochs
    ck = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert any("batch_normalization/moving_mean" in k for k in ck["model"])  # Keras' own variable names


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_keras_adapter_passes_train_and_eval_modes():
    if importlib.util.find_spec("keras") is None:
        pytest.skip("keras not installed")
    from ddplab.models.keras_convnet import keras_convnet

    m = keras_convnet(num_classes=10, in_channels=1, image_size=8)
    x = torch.randn(4, 1, 8, 8)
    m.train()
    assert not torch.equal(m(x), m(x))  # dropout active
    m.eval()
    assert torch.equal(m(x), m(x))
    assert len(keras_convnet().state_dict()) == len(m.state_dict())  # same names on a rebuild
    assert set(keras_convnet().state_dict()) == set(m.state_dict())


def test_any_installed_factory_via_target(tmp_path):
    """A user's own factory (here tests/toy.py; torchvision's or timm's work the same way)."""
    out = ddplab.run(
        compose_cfg(
            [
                "model=mlp",
                "model._target_=toy.UnusedParamMLP",
                "num_epochs=1",
                "progress=none",
                "distributed.find_unused_parameters=true",
            ],
            run_dir=tmp_path,
        )
    )
    assert out["val/num_samples"] == 359
