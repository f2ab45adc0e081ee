"""Image parts in the prompt: the messages as the chat template reads them, and the placeholders.

A message holding images reaches the template as a content list (``{type: text, text}`` and
``{type: image}`` parts, which Qwen2-VL's template and transformers' processors read), so the
template writes its one placeholder per image (``<|vision_start|><|image_pad|><|vision_end|>``).
After tokenization each placeholder token becomes ``num_tokens`` copies of it, as the model's
processor expands it, and the image's ``offset`` is where its copies start.
"""

from __future__ import annotations

from django.conf import settings

from apps.api.images import PreparedImage, VisionSpec, images_prepare, vision_spec
from apps.api.images.errors import InvalidImage
from apps.core.errors import InvalidRequest


def image_parts(messages: list[dict]) -> list[dict]:
    """The image parts of ``messages``, in prompt order."""
    return [
        part
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if part.get("type") == "image_url"
    ]


def template_messages(messages: list[dict]) -> list[dict]:
    """``messages`` with each content list as the template reads it (the URLs and params left out)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = [
                {"type": "image"} if p["type"] == "image_url" else {"type": "text", "text": p["text"]} for p in content
            ]
            m = {**m, "content": content}
        out.append(m)
    return out


def prompt_images(served, messages: list[dict]) -> tuple[list[dict], VisionSpec | None, list[dict]]:
    """(messages for the template, the model's VisionSpec, the image parts) of a request; a
    text-only request comes back unchanged with (None, []). Refuses (invalid_image) images sent
    to a model that reads none and more than ``model.max_images``: nothing fetched or decoded yet."""
    parts = image_parts(messages)
    if not parts:
        return messages, None, []
    spec = vision_spec(served.path)
    if spec is None:
        raise InvalidImage(
            f"The model '{served.served_id}' reads text only; image parts are not supported.", param=parts[0]["param"]
        )
    limit = settings.IGNIS["model.max_images"]
    if len(parts) > limit:
        raise InvalidImage(
            f"This request holds {len(parts)} images; at most {limit} are read (model.max_images).",
            param=parts[limit]["param"],
        )
    return template_messages(messages), spec, parts


def images_attach(
    ids: list[int], spec: VisionSpec | None, parts: list[dict], *, param: str = "messages"
) -> tuple[list[int], list[dict] | None]:
    """(prompt ids with each image's placeholder expanded, AddRequest.images); (ids, None) without images.

    The template must have written exactly one placeholder per image: text that spells the
    placeholder itself (or a template that drops an image) is refused, never guessed at. Then
    every image is acquired and prepared (the first refusal refuses the request)."""
    if not parts:
        return ids, None
    token = spec.image_token_id
    at = [i for i, t in enumerate(ids) if t == token]
    if len(at) != len(parts):
        raise InvalidRequest(
            f"The prompt holds {len(at)} image placeholders for {len(parts)} images "
            "(does a message's text spell the placeholder token?).",
            param=param,
        )
    images: list[PreparedImage] = images_prepare(parts, spec)
    out: list[int] = []
    entries: list[dict] = []
    prev = 0
    for pos, image in zip(at, images):
        out.extend(ids[prev:pos])
        entries.append(image.to_message(len(out)))
        out.extend([token] * image.num_tokens)
        prev = pos + 1
    out.extend(ids[prev:])
    return out, entries
