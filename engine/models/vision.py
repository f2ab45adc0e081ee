"""The Qwen2.5-VL vision tower as data: its geometry, its operations, and how images sit in a prompt.

A tower (``VisionConfig``) turns one image's patches into placeholder-token embeddings:

1. ``patch_embed``: each patch row (``patch_dim`` values: channels x temporal x patch x patch,
   the processor's order) times ``visual.patch_embed.proj`` ([hidden, patch_dim]: the Conv3d
   whose stride is its kernel, flattened), no bias;
2. the rows are reordered by windows (:func:`window_index`: groups of ``merge**2`` rows, one
   merge block each, window by window) and so are their 2D rotary angles
   (:func:`rotary_positions`: each patch's (h, w); the head's first half rotates by h, the
   second by w, ``rotate_half`` pairing over the whole head);
3. ``depth`` blocks: ``x += proj(attention(rope(q), rope(k), v))`` over ``norm1(x)`` then
   ``x += down(act(gate(h)) * up(h))`` over ``norm2(x)`` (RMSNorm eps 1e-6, every linear with a
   bias), attention bidirectional within a window, or within a frame in the blocks of
   ``fullatt_block_indexes``;
4. the merger: ``ln_q`` (RMSNorm), each ``merge**2`` consecutive rows concatenated, then
   ``mlp.0`` (bias), exact GELU, ``mlp.2`` (bias) to ``out_hidden_size``; the rows go back
   from window order to the processor's (merge-block) order, one per placeholder token.

The positions of a prompt's rows under multimodal rope (:func:`rope_index`) follow
transformers' ``get_rope_index``; ``check_images`` validates what ``AddRequest.images`` carries.
Backends implement the computation (``engine/backends/numpy/vision.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.model_config import VisionConfig


@dataclass(eq=False)
class Image:
    """One image of a request, as the engine holds it (parsed from ``AddRequest.images``)."""

    hash: str
    offset: int  # prompt index of its first placeholder token
    num_tokens: int
    grid_thw: tuple[int, int, int]  # in patches
    pixel_values: np.ndarray  # float32 [t*h*w, patch_dim]
    embeds: object | None = None  # the backend's encoded rows, kept on the sequence until consumed

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def rotary_positions(grid_thw: tuple[int, int, int], merge: int) -> np.ndarray:
    """Each patch's (h, w) in the processor's order (merge blocks row-major, patches row-major
    within): int64 [t*h*w, 2] (transformers' ``get_vision_position_ids``)."""
    t, h, w = grid_thw
    hpos, wpos = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    hpos = hpos.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    wpos = wpos.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    return np.tile(np.stack([hpos, wpos], axis=-1), (t, 1))


def window_index(grid_thw: tuple[int, int, int], cfg: VisionConfig) -> tuple[np.ndarray, list[int]]:
    """``(index, bounds)``: merge blocks in window order (``index[i]`` is the processor-order merge
    block at window-order place i) and the row bounds of each window in that order (row 0, ...,
    the image's rows), as transformers' ``get_vision_window_index`` for one image."""
    t, h, w = grid_thw
    m = cfg.spatial_merge_size
    ws = cfg.window_size // m // cfg.patch_size  # merge blocks a window side
    gh, gw = h // m, w // m
    nh, nw = -(-gh // ws), -(-gw // ws)
    grid = np.full((t, nh * ws, nw * ws), -1, dtype=np.int64)
    grid[:, :gh, :gw] = np.arange(t * gh * gw).reshape(t, gh, gw)
    windows = grid.reshape(t, nh, ws, nw, ws).transpose(0, 1, 3, 2, 4).reshape(t * nh * nw, ws * ws)
    index = windows[windows >= 0]
    bounds = [0]
    for count in (windows >= 0).sum(axis=1):
        if count:
            bounds.append(bounds[-1] + int(count) * m * m)
    return index, bounds


def frame_bounds(grid_thw: tuple[int, int, int]) -> list[int]:
    """Row bounds of the full-attention blocks' segments: one per frame."""
    t, h, w = grid_thw
    return [i * h * w for i in range(t + 1)]


def rope_index(num_tokens: int, images: list[Image], merge: int) -> tuple[np.ndarray, int]:
    """``(positions [3, num_tokens], rope_delta)`` of a prompt's rows under multimodal rope.

    Text rows count on from the previous row (all three positions alike); an image's rows take
    ``start + (t, h, w)`` of their merge block (processor order), ``start`` being where the text
    before it left off, and the text after it goes on from ``start + max(h, w) / merge``
    (transformers' ``get_rope_index``). Row p beyond the prompt (decode) is at ``p + rope_delta``
    in all three, ``rope_delta`` = the prompt's largest position + 1 - ``num_tokens``.
    """
    pos = np.empty((3, num_tokens), dtype=np.int64)
    cur, prev = 0, 0
    for img in images:
        n = img.offset - prev
        pos[:, prev : img.offset] = cur + np.arange(n)
        cur += n
        t, h, w = img.grid_thw[0], img.grid_thw[1] // merge, img.grid_thw[2] // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        pos[:, img.offset : img.end] = cur + np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)])
        cur += max(h, w)
        prev = img.end
    pos[:, prev:] = cur + np.arange(num_tokens - prev)
    delta = int(pos.max()) + 1 - num_tokens if num_tokens else 0
    return pos, delta


class ImageError(ValueError):
    """An ``AddRequest.images`` entry the engine cannot take (the request fails: invalid_image)."""


def check_images(raw: list[dict] | None, prompt: list[int], cfg: VisionConfig | None) -> list[Image]:
    """The request's images parsed and checked against its prompt and the tower; ImageError says
    what is wrong (images for a text-only model, a grid the tower cannot merge, pixel bytes of
    the wrong size, placeholders that are not where the entry says, an image placeholder
    token no entry covers)."""
    if not raw:
        if cfg is not None and cfg.image_token_id is not None and cfg.image_token_id in prompt:
            raise ImageError("The prompt holds image placeholder tokens but the request carries no image.")
        return []
    if cfg is None:
        raise ImageError("This model does not take images.")
    if not isinstance(raw, list):
        raise ImageError("images must be a list.")
    m, images, end = cfg.spatial_merge_size, [], 0
    for i, entry in enumerate(raw):
        where = f"image {i}"
        try:
            t, h, w = (int(v) for v in entry["grid_thw"])
            offset, num_tokens = int(entry["offset"]), int(entry["num_tokens"])
            data, digest = entry["pixel_values"], str(entry["hash"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ImageError(f"{where}: a malformed entry ({exc.__class__.__name__}: {exc}).") from None
        if min(t, h, w) < 1 or h % m or w % m:
            raise ImageError(f"{where}: grid_thw {[t, h, w]} is not whole {m}x{m} merge blocks.")
        if num_tokens != t * h * w // (m * m):
            raise ImageError(f"{where}: num_tokens {num_tokens}, its grid {[t, h, w]} makes {t * h * w // (m * m)}.")
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ImageError(f"{where}: pixel_values must be bytes.")
        if len(data) != t * h * w * cfg.patch_dim * 4:
            raise ImageError(
                f"{where}: pixel_values holds {len(data)} bytes, its grid needs {t * h * w} x {cfg.patch_dim} float32."
            )
        if offset < end or offset + num_tokens > len(prompt):
            raise ImageError(f"{where}: placeholders at {offset}..{offset + num_tokens} overlap or leave the prompt.")
        if any(tok != cfg.image_token_id for tok in prompt[offset : offset + num_tokens]):
            raise ImageError(
                f"{where}: the prompt's tokens at {offset}..{offset + num_tokens} are not all placeholders."
            )
        pixels = np.frombuffer(bytes(data), dtype="<f4").reshape(t * h * w, cfg.patch_dim)
        if not np.isfinite(pixels).all():
            raise ImageError(f"{where}: pixel_values are not all finite.")
        images.append(Image(digest, offset, num_tokens, (t, h, w), pixels))
        end = offset + num_tokens
    covered = sum(img.num_tokens for img in images)
    if cfg.image_token_id is not None and sum(1 for tok in prompt if tok == cfg.image_token_id) != covered:
        raise ImageError("The prompt holds image placeholder tokens that no image covers.")
    return images
