"""Bytes to a Pillow image, refusing what a server should not decode.

The header is read first (``Image.open`` is lazy): an unsupported format or more pixels than
``model.max_image_pixels`` is refused before a single pixel is decoded, so a small file that
inflates to gigapixels (a decompression bomb) costs a header read. Pillow's own bomb check
(``Image.MAX_IMAGE_PIXELS``) stays on beneath ours. A multi-frame image (GIF, APNG, WebP)
gives its first frame.
"""

from __future__ import annotations

import io

from django.conf import settings
from PIL import Image, UnidentifiedImageError

from apps.api.images.errors import InvalidImage

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # the formats OpenAI's API takes


def image_decode(data: bytes, *, param: str) -> Image.Image:
    """The decoded first frame of ``data``; InvalidImage when it is no image, a format not in
    FORMATS, or larger than ``model.max_image_pixels``."""
    if not data:
        raise InvalidImage("The image is empty.", param=param)
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise InvalidImage("The image has more pixels than this server decodes.", param=param) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise InvalidImage("The image data does not decode as an image.", param=param) from None
    if image.format not in FORMATS:
        raise InvalidImage(
            f"Unsupported image format {image.format}; send one of {', '.join(f.lower() for f in FORMATS)}.",
            param=param,
        )
    width, height = image.size
    limit = settings.IGNIS["model.max_image_pixels"]
    if width * height > limit:
        raise InvalidImage(
            f"The image is {width}x{height} = {width * height} pixels; the limit is {limit} (model.max_image_pixels).",
            param=param,
        )
    if width < 1 or height < 1:
        raise InvalidImage("The image has no pixels.", param=param)
    try:
        image.load()
    except Image.DecompressionBombError:
        raise InvalidImage("The image has more pixels than this server decodes.", param=param) from None
    except (OSError, ValueError, SyntaxError, EOFError):
        raise InvalidImage("The image data is truncated or corrupt.", param=param) from None
    return image
