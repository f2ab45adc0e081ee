"""A tiny servable random-weight Qwen2.5-VL checkpoint, and what transformers' processor makes of an image.

``write_tiny_qwen2_5_vl`` writes a Hugging Face directory the server loads: transformers' own
``Qwen2_5_VLForConditionalGeneration`` (2 text layers of hidden 64; a vision tower of depth 2 whose
block 1 attends over the whole image and block 0 in windows of 2x2 merged patches; the real
mrope_section shape), the default GGUF's vocabulary plus the vision special tokens as added tokens
(their ids in config.json), a ``preprocessor_config.json`` for ``Qwen2VLImageProcessor`` with small
min/max pixels (at most 16 placeholder tokens per image), and Qwen2.5-VL's chat template (an image
part renders as ``<|vision_start|><|image_pad|><|vision_end|>``, the Django side expands the pad).

``processor_outputs`` is what transformers' processor returns for a PIL image (the reference for the
Django side's preparation and the engine's input in parity tests); ``hf_processor`` the whole
``Qwen2_5_VLProcessor`` (tokenizer, template and placeholder expansion) over the directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
PATCH, TEMPORAL, MERGE = 14, 2, 2
MIN_PIXELS, MAX_PIXELS = 4 * 28 * 28, 16 * 28 * 28  # 56x56 .. 112x112 after smart resize: 1..16 tokens
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]

# Qwen2.5-VL-7B-Instruct's chat template (its chat_template.json).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "resample": 3,
    "image_mean": IMAGE_MEAN,
    "image_std": IMAGE_STD,
    "min_pixels": MIN_PIXELS,
    "max_pixels": MAX_PIXELS,
    "patch_size": PATCH,
    "temporal_patch_size": TEMPORAL,
    "merge_size": MERGE,
}


def write_tiny_qwen2_5_vl(target: Path, default_gguf: Path, *, seed: int = 0) -> Path:
    """``target`` as a servable HF directory of a random tiny Qwen2.5-VL; returns ``target``."""
    import torch
    from tokenizers import AddedToken
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from engine.tokenizer import load_tokenizer

    bundle = load_tokenizer(default_gguf)
    tok = bundle.tokenizer
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    ids = {t: tok.token_to_id(t) for t in VISION_TOKENS}
    torch.manual_seed(seed)
    text = dict(
        vocab_size=tok.get_vocab_size(with_added_tokens=True), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=bundle.bos_token_id, eos_token_id=bundle.eos_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )  # fmt: skip
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=PATCH,
        spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, tokens_per_second=2, window_size=56,
        out_hidden_size=64, fullatt_block_indexes=[1], initializer_range=0.1,
    )  # fmt: skip
    cfg = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True,
    )  # fmt: skip
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # norms around 1 and biases non-zero, so a swapped or missing one shows
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")):
                p.normal_(1.0, 0.2)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    (target / "generation_config.json").unlink(missing_ok=True)
    tok.save(str(target / "tokenizer.json"))
    added = {
        str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                 "single_word": False}
        for t, i in ids.items()
    }  # fmt: skip
    meta = {
        "chat_template": CHAT_TEMPLATE,
        "bos_token": bundle.bos_token,
        "eos_token": bundle.eos_token,
        "pad_token": bundle.eos_token,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "extra_special_tokens": {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
    }
    (target / "tokenizer_config.json").write_text(json.dumps(meta))
    (target / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=1))
    return target


_CACHE = Path(os.environ.get("TMPDIR", "/tmp")) / f"ignis-tiny-qwen2_5_vl-{os.getuid()}"


def tiny_vl_dir(default_gguf: Path) -> Path:
    """The seed-0 checkpoint, written once per machine (a cache under TMPDIR; ~8 s to write)."""
    if not (_CACHE / "preprocessor_config.json").exists():
        tmp = _CACHE.with_name(_CACHE.name + f".{os.getpid()}")
        write_tiny_qwen2_5_vl(tmp, default_gguf)
        shutil.rmtree(_CACHE, ignore_errors=True)
        tmp.rename(_CACHE)
    return _CACHE


def image_processor(model_dir: Path):
    """transformers' image processor for the directory (its PIL backend when torchvision is absent)."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))


def processor_outputs(model_dir: Path, image) -> tuple[np.ndarray, list[int]]:
    """``(pixel_values, grid_thw)`` transformers' processor gives for one PIL ``image``: pixel_values
    float32 of shape (t*h*w, 3*2*14*14) in the processor's patch order, grid_thw [t, h, w] in patches."""
    out = image_processor(model_dir)(images=[image], return_tensors="np")
    return np.asarray(out["pixel_values"], dtype=np.float32), [int(v) for v in out["image_grid_thw"][0]]


def hf_processor(model_dir: Path):
    """transformers' ``Qwen2_5_VLProcessor`` over the directory (tokenizer, chat template, image
    processor), without its video processor (which needs torchvision, absent here)."""
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLProcessor

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    return ImageOnlyProcessor(image_processor=image_processor(model_dir), tokenizer=tokenizer,
                              chat_template=CHAT_TEMPLATE)  # fmt: skip


def test_image(width: int, height: int, *, seed: int = 0):
    """A PIL RGB image of smooth random colour (deterministic per seed), for parity tests."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.BILINEAR)


test_image.__test__ = False  # a helper, not a test (pytest collects test_* names imported into test modules)


def chat_inputs(model_dir: Path, images: list, text: str) -> dict:
    """transformers' processor over one user turn (``images``, then ``text``) with the generation
    prompt: input_ids (placeholders expanded), pixel_values, image_grid_thw, mm_token_type_ids (torch)."""
    proc = hf_processor(model_dir)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    rendered = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=False)  # fmt: skip
    return dict(proc(text=[rendered], images=images or None, return_tensors="pt"))


def image_entries(inputs: dict, image_token_id: int, merge: int = MERGE) -> list[dict]:
    """``AddRequest.images`` for ``chat_inputs``' output, as the contract in engine/messages.py reads."""
    ids = inputs["input_ids"][0].tolist()
    if "image_grid_thw" not in inputs:
        return []
    pixels = np.asarray(inputs["pixel_values"], dtype=np.float32)
    out, row, pos = [], 0, 0
    for grid in inputs["image_grid_thw"].tolist():
        patches = grid[0] * grid[1] * grid[2]
        pv = np.ascontiguousarray(pixels[row : row + patches], dtype="<f4")
        offset = ids.index(image_token_id, pos)
        digest = hashlib.sha256(np.asarray(grid, dtype="<i8").tobytes() + pv.tobytes()).hexdigest()
        out.append({"hash": digest, "offset": offset, "num_tokens": patches // merge**2, "grid_thw": grid,
                    "pixel_values": pv.tobytes()})  # fmt: skip
        row, pos = row + patches, offset + patches // merge**2
    return out
