"""The training benchmark's real-model option: samples as images, the CLI's --model forms."""

from __future__ import annotations

import argparse

import pytest

torch = pytest.importorskip("torch")

from spokefs_bench.training.loop import (  # noqa: E402  (after the torch skip)
    ARCH_SHAPES,
    LoopConfig,
    batch_images,
    collate,
    collate_tensor,
    sample_image,
)

RESNET_BYTES = 3 * 224 * 224


def test_sample_image_crops_and_pads() -> None:
    data = bytes(range(256)) * 1000  # 256,000 bytes: longer than one 3x224x224 image
    assert sample_image(data, RESNET_BYTES) == data[:RESNET_BYTES]
    short = sample_image(b"\x01\x02\x03", RESNET_BYTES)
    assert len(short) == RESNET_BYTES
    assert short[:3] == b"\x01\x02\x03" and short[3:] == bytes(RESNET_BYTES - 3)
    assert sample_image(memoryview(data)[:10], 4) == data[:4]


def test_both_collates_give_the_same_images() -> None:
    items = [{"image": sample_image(bytes([k]) * 100_000, RESNET_BYTES), "label": k,
              "bytes": 100_000, "ok": True} for k in range(3)]
    as_bytes, as_tensor = collate(items), collate_tensor(items)
    assert isinstance(as_tensor["image"], torch.Tensor)
    shape = ARCH_SHAPES["resnet50"]
    a, b = batch_images(as_bytes, shape), batch_images(as_tensor, shape)
    assert a.shape == (3, 3, 224, 224) and torch.equal(a, b)
    assert a[1, 0, 0, 0].item() == pytest.approx(1 / 255)
    assert a[2, 2, 223, 223].item() == 0.0  # past the sample's 100,000 bytes: padding
    assert as_tensor["label"] == [0, 1, 2]


def test_loop_config_image_shape() -> None:
    assert LoopConfig().image_shape == (3, 32, 32)
    assert LoopConfig(model=True).image_shape == (3, 32, 32)
    assert LoopConfig(model=True, arch="resnet50").image_shape == (3, 224, 224)
    assert LoopConfig(arch="resnet50").image_shape == (3, 32, 32)  # the sleep: no model


def _parse(*argv: str) -> argparse.Namespace:
    from spokefs_bench import train

    parser = argparse.ArgumentParser()
    train.register(parser.add_subparsers())
    return parser.parse_args(["train", "--out", "/tmp/x", *argv])


def test_cli_model_forms() -> None:
    assert _parse().model is None
    assert _parse("--model").model == "tiny"
    args = _parse("--model", "resnet50", "--device", "cuda")
    assert (args.model, args.device) == ("resnet50", "cuda")
    with pytest.raises(SystemExit):
        _parse("--model", "vgg")
