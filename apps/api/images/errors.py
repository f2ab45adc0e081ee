"""The one refusal of an image: 400 ``invalid_image``, ``param`` naming the part (``messages[0].content[1]``)."""

from __future__ import annotations

from apps.core.errors import InvalidRequest


class InvalidImage(InvalidRequest):
    code = "invalid_image"
