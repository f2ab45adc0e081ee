"""Qwen2-VL's image processor (Qwen2.5-VL uses the same), in numpy and Pillow.

Why here and not transformers: the server ships without torch or transformers at run time
(requirements.txt); transformers is a test dependency, the reference this module is tested
against (tests/api/test_images_processor.py: ``np.allclose`` on images of odd sizes and modes).
It follows transformers' Pillow backend, ``Qwen2VLImageProcessorPil`` (what
``AutoImageProcessor`` gives without torchvision), step by step:

1. RGB: an image with alpha (or a palette's transparency) is composited onto white first.
2. ``smart_resize``: height and width to multiples of ``patch_size * merge_size`` (28), the
   pixel count within ``[min_pixels, max_pixels]``, the aspect ratio kept; Pillow's resize
   of the uint8 RGB image with the processor's ``resample`` (bicubic).
3. Rescale in float64 (``* rescale_factor``) then float32; normalise in float32
   (``(x - image_mean) / image_std`` per channel).
4. Patchify: the image repeated ``temporal_patch_size`` times along time (an image is one
   frame), cut into ``patch_size`` squares grouped by ``merge_size`` windows, rows of
   ``channels * temporal_patch_size * patch_size**2`` values in (C, T, ph, pw) order, the
   rows in (grid_h / merge, grid_w / merge, merge, merge) order. ``grid_thw`` is
   ``[1, grid_h, grid_w]``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ProcessorConfig:
    """preprocessor_config.json's fields that shape pixel_values (Qwen2VLImageProcessor's defaults)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL.Image.Resampling.BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, raw: dict, vision: dict | None = None) -> ProcessorConfig:
        """As the processor's __init__ reads it: ``size`` {shortest_edge, longest_edge}, then
        ``min_pixels`` / ``max_pixels`` over it; patch sizes default to the vision config's."""
        vision = vision or {}
        size = raw.get("size") or {}
        kw: dict = {
            "patch_size": vision.get("patch_size", cls.patch_size),
            "temporal_patch_size": vision.get("temporal_patch_size", cls.temporal_patch_size),
            "merge_size": vision.get("spatial_merge_size", cls.merge_size),
        }
        if size.get("shortest_edge") is not None:
            kw["min_pixels"] = int(size["shortest_edge"])
        if size.get("longest_edge") is not None:
            kw["max_pixels"] = int(size["longest_edge"])
        for key in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "resample"):
            if raw.get(key) is not None:
                kw[key] = int(raw[key])
        for key in ("image_mean", "image_std"):
            if raw.get(key) is not None:
                value = raw[key]
                kw[key] = tuple(float(v) for v in (value if isinstance(value, list) else [value] * 3))
        if raw.get("rescale_factor") is not None:
            kw["rescale_factor"] = float(raw["rescale_factor"])
        for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if raw.get(key) is not None:
                kw[key] = bool(raw[key])
        return cls(**kw)

    @classmethod
    def from_dir(cls, path: Path, vision: dict | None = None) -> ProcessorConfig:
        """preprocessor_config.json in a model directory (the processor's defaults without one)."""
        file = Path(path) / "preprocessor_config.json"
        raw = json.loads(file.read_text()) if file.is_file() else {}
        return cls.from_dict(raw, vision)


def smart_resize(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) as multiples of ``factor`` with ``min_pixels <= h*w <= max_pixels``,
    the aspect ratio as close as may be (transformers' ``smart_resize``). ValueError past 200:1."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"the aspect ratio must be below 200:1, got {max(height, width) / min(height, width):.0f}:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white (transformers' ``convert_to_rgb``)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def num_image_tokens(grid_thw: tuple[int, int, int], merge_size: int) -> int:
    """Placeholder tokens an image takes in the prompt: t*h*w / merge_size**2."""
    t, h, w = grid_thw
    return t * h * w // (merge_size * merge_size)


def preprocess(image: Image.Image, cfg: ProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One decoded image as (pixel_values float32 (t*h*w, C*T*p*p), grid_thw (1, h, w))."""
    if cfg.do_convert_rgb:
        image = to_rgb(image)
    if cfg.do_resize:
        height, width = smart_resize(
            image.height, image.width, factor=cfg.factor, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels
        )
        image = image.resize((width, height), resample=cfg.resample)
    pixels = np.asarray(image)
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    x = pixels.astype(np.float64) * cfg.rescale_factor if cfg.do_rescale else pixels
    x = x.astype(np.float32)
    if cfg.do_normalize:
        mean = np.asarray(cfg.image_mean, dtype=np.float32)
        std = np.asarray(cfg.image_std, dtype=np.float32)
        x = (x - mean) / std
    x = np.ascontiguousarray(x.transpose(2, 0, 1))  # (C, H, W)
    return patchify(x, cfg)


def patchify(x: np.ndarray, cfg: ProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(C, H, W) float32 into the processor's rows; H and W are multiples of patch*merge."""
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    channels, height, width = x.shape
    gh, gw = height // p, width // p
    patches = x.reshape(channels, gh // m, m, p, gw // m, m, p)
    patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, p, p)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], tp, p, p))
    rows = np.ascontiguousarray(patches.reshape(gh * gw, channels * tp * p * p), dtype=np.float32)
    return rows, (1, gh, gw)
