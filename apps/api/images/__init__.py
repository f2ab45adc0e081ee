"""Images in prompts, for a vision-language model (Qwen2.5-VL): everything before the engine.

A request's image parts are acquired (``acquire``: data: URLs, http(s) when allowed), decoded
(``decode``: Pillow, the header checked before any pixel), and prepared as the model's own
processor prepares them (``processor``); ``prompt`` renders the content lists through the chat
template and expands each image's one placeholder to its tokens. All of it runs off the event
loop (the services' threads), at most ``PREPARE_SLOTS`` images at a time in the process, and a
request reaches the engine only once every image is prepared; any refusal is a 400
``invalid_image`` naming the part (``messages[0].content[1]``, ``input[2].content[0]``).

What crosses to the engine is ``AddRequest.images`` (engine/messages.py: the contract).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from apps.api.images.acquire import image_bytes
from apps.api.images.decode import image_decode
from apps.api.images.errors import InvalidImage
from apps.api.images.processor import ProcessorConfig, num_image_tokens, preprocess

__all__ = ["InvalidImage", "PreparedImage", "VisionSpec", "image_prepare", "images_prepare", "vision_spec"]

# Decoding and resizing are CPU work holding big buffers: a burst of image requests queues here
# rather than decoding dozens of images at once.
PREPARE_SLOTS = max(1, min(4, (os.cpu_count() or 2) // 2))
_slots = threading.BoundedSemaphore(PREPARE_SLOTS)


@dataclass(frozen=True)
class VisionSpec:
    """What the Django side needs of a model that reads images."""

    image_token_id: int  # the placeholder the template writes once per image (<|image_pad|>)
    processor: ProcessorConfig


@dataclass
class PreparedImage:
    pixel_values: np.ndarray  # float32 (t*h*w, C*T*p*p), the processor's rows
    grid_thw: tuple[int, int, int]
    num_tokens: int  # placeholder tokens in the prompt
    hash: str  # sha256 hex of grid_thw (three little-endian int64) then the pixel bytes
    param: str

    def to_message(self, offset: int) -> dict:
        """One entry of AddRequest.images, its placeholder tokens starting at ``offset``."""
        return {
            "hash": self.hash,
            "offset": offset,
            "num_tokens": self.num_tokens,
            "grid_thw": list(self.grid_thw),
            "pixel_values": self.pixel_values.astype("<f4", copy=False).tobytes(),
        }


def vision_spec(path: str | Path) -> VisionSpec | None:
    """The served artifact's VisionSpec, or None for a model that reads text only."""
    return _vision_spec(str(Path(path).resolve()))


@functools.lru_cache(maxsize=16)
def _vision_spec(path: str) -> VisionSpec | None:
    root = Path(path)
    cfg_file = root / "config.json"
    if not root.is_dir() or not cfg_file.is_file():
        return None  # a GGUF carries no vision tower
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError):
        return None
    vision = cfg.get("vision_config")
    token_id = cfg.get("image_token_id", cfg.get("image_token_index"))
    if token_id is None and isinstance(cfg.get("text_config"), dict):
        token_id = cfg["text_config"].get("image_token_id")
    if not isinstance(vision, dict) or not isinstance(token_id, int):
        return None
    return VisionSpec(image_token_id=token_id, processor=ProcessorConfig.from_dir(root, vision))


def image_prepare(part: dict, spec: VisionSpec) -> PreparedImage:
    """One image part (``{type: image_url, image_url: {url}, param}``) acquired, decoded and prepared."""
    param = part["param"]
    data = image_bytes(part["image_url"]["url"], param=param)
    with _slots:
        image = image_decode(data, param=param)
        try:
            pixel_values, grid_thw = preprocess(image, spec.processor)
        except ValueError as exc:  # smart_resize's aspect ratio bound
            raise InvalidImage(f"The image cannot be prepared: {exc}.", param=param) from None
        except OSError:
            raise InvalidImage("The image data is truncated or corrupt.", param=param) from None
    digest = hashlib.sha256(struct.pack("<3q", *grid_thw))
    digest.update(memoryview(pixel_values).cast("B"))
    return PreparedImage(
        pixel_values=pixel_values,
        grid_thw=grid_thw,
        num_tokens=num_image_tokens(grid_thw, spec.processor.merge_size),
        hash=digest.hexdigest(),
        param=param,
    )


def images_prepare(parts: list[dict], spec: VisionSpec) -> list[PreparedImage]:
    """Every image part, in order (the first refusal refuses the request)."""
    return [image_prepare(part, spec) for part in parts]
