"""apps/api/images/processor.py against transformers' own Qwen2-VL image processor (what
``AutoImageProcessor`` loads from the checkpoint's preprocessor_config.json) on images of odd
sizes and modes: tiny, tall, wide, square, RGBA, palette (with transparency), grayscale, and
sizes past max_pixels and below min_pixels."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from apps.api.images.processor import ProcessorConfig, preprocess, smart_resize
from tests.models.tiny_vl import PREPROCESSOR

pytestmark = pytest.mark.slow  # imports transformers


def _image(width: int, height: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    rgba = Image.fromarray(rng.integers(0, 256, size=(height, width, 4), dtype=np.uint8), "RGBA")
    if mode == "P":  # a palette with one transparent entry
        image = rgba.convert("RGB").quantize(colors=16)
        image.info["transparency"] = 3
        return image
    return rgba if mode == "RGBA" else rgba.convert(mode)


CASES = [
    (5, 7, "RGB"),  # tiny: scaled up to min_pixels
    (1, 1, "L"),
    (30, 900, "RGB"),  # tall
    (1000, 40, "RGBA"),  # wide, with alpha
    (333, 211, "P"),
    (64, 64, "L"),  # grayscale
    (601, 599, "LA"),
    (28, 28, "RGB"),
    (2000, 1500, "RGB"),  # past max_pixels
    (97, 13, "CMYK"),
]


@pytest.fixture(scope="module", params=["tiny", "qwen2.5-vl-7b"])
def model_dir(request, tmp_path_factory):
    """A directory with the preprocessor config of the tiny checkpoint, or Qwen2.5-VL-7B's (its defaults)."""
    config = dict(PREPROCESSOR)
    if request.param != "tiny":
        config.update(min_pixels=3136, max_pixels=12845056)
    path = tmp_path_factory.mktemp(request.param)
    (path / "preprocessor_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("width,height,mode", CASES)
def test_pixel_values_match_transformers(model_dir, width, height, mode):
    from transformers import AutoImageProcessor

    reference = AutoImageProcessor.from_pretrained(str(model_dir))
    image = _image(width, height, mode, seed=width * height)
    want = reference(images=[image], return_tensors="np")
    got, grid = preprocess(image, ProcessorConfig.from_dir(model_dir))
    assert list(grid) == want["image_grid_thw"][0].tolist()
    assert got.dtype == np.float32 and got.shape == want["pixel_values"].shape
    assert np.allclose(got, want["pixel_values"], rtol=1e-6, atol=1e-6)


def test_smart_resize_matches_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as reference

    rng = np.random.default_rng(0)
    for height, width in rng.integers(1, 5000, size=(200, 2)).tolist():
        if max(height, width) / min(height, width) > 200:
            with pytest.raises(ValueError):
                smart_resize(height, width, factor=28, min_pixels=3136, max_pixels=1003520)
            continue
        want = reference(height, width, factor=28, min_pixels=3136, max_pixels=1003520)
        assert smart_resize(height, width, factor=28, min_pixels=3136, max_pixels=1003520) == want


def test_the_processor_config_reads_size_and_the_vision_config():
    cfg = ProcessorConfig.from_dict({"size": {"shortest_edge": 100, "longest_edge": 9000}}, {"spatial_merge_size": 3})
    assert (cfg.min_pixels, cfg.max_pixels, cfg.merge_size, cfg.factor) == (100, 9000, 3, 42)
    cfg = ProcessorConfig.from_dict({"size": {"shortest_edge": 100, "longest_edge": 9000}, "max_pixels": 5000})
    assert (cfg.min_pixels, cfg.max_pixels) == (100, 5000)  # min/max_pixels over size, as the processor's __init__
