"""qwen2_5_vl on the numpy backend against transformers on the tiny random checkpoint
(tests/models/tiny_vl.py), fed the images transformers' processor prepares.

Relative error is ``max|ours - theirs| / max|theirs|`` over a row of logits. The backend is
driven through the step interface as the scheduler drives it: spans carry the rows' three rope
positions and the images they reach (engine.models.vision), decode lanes their rope delta.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.backend import DecodeLane, PrefillSpan, SampleRequest, StepOutput
from engine.backends.numpy import NumpyBackend
from engine.loaders import load_artifact
from engine.models import definition
from engine.models.vision import ImageError, check_images, rope_index, window_index
from engine.sampling import SamplingParams
from tests.models.tiny_vl import chat_inputs, image_entries, test_image, tiny_vl_dir

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

MAX_REL_ERR = 1e-4
GREEDY = SampleRequest(params=SamplingParams(temperature=0), seed=0)
TABLE = list(range(16))  # blocks of 16: 256 positions


def rel_err(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def vl_dir(default_gguf_path):
    return tiny_vl_dir(default_gguf_path)


@pytest.fixture(scope="module")
def loaded(vl_dir):
    cfg, weights = load_artifact(vl_dir)
    backend = NumpyBackend()
    backend.load(cfg, weights, block_size=16, kv_budget_bytes=None, host_kv_budget_bytes=0, max_context=256)
    return cfg, backend


@pytest.fixture(scope="module")
def hf_model(vl_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(str(vl_dir), dtype=torch.float32).eval()


def engine_inputs(cfg, inputs):
    """(prompt ids, images, rope positions or None, rope delta) as the scheduler holds them."""
    ids = inputs["input_ids"][0].tolist()
    images = check_images(image_entries(inputs, cfg.vision.image_token_id), ids, cfg.vision)
    if not images:
        return ids, images, None, 0
    positions, delta = rope_index(len(ids), images, cfg.vision.spatial_merge_size)
    return ids, images, positions, delta


def prefill(backend, ids, images, positions, bounds=None) -> StepOutput:
    """The prompt in spans cut at ``bounds`` (None: one span); the last span samples."""
    cuts = [0, *(bounds or []), len(ids)]
    for img in images:
        img.embeds = None
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        out = StepOutput()
        last = hi == len(ids)
        backend.prefill(PrefillSpan(
            0, ids[lo:hi], lo, TABLE, sample=GREEDY if last else None, want_logits=last,
            rope_positions=None if positions is None else positions[:, lo:hi],
            images=[img for img in images if img.offset < hi and img.end > lo],
        ), out)  # fmt: skip
    return out


CASES = {
    "one image": ([(100, 70)], "What is this?"),
    "two images": ([(100, 70), (60, 110)], "Compare them."),
    "text only": ([], "Name three colors."),
}


@pytest.mark.parametrize("case", CASES)
def test_last_position_logits_match_transformers(case, vl_dir, loaded, hf_model):
    cfg, backend = loaded
    sizes, text = CASES[case]
    inputs = chat_inputs(vl_dir, [test_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)], text)
    ids, images, positions, _ = engine_inputs(cfg, inputs)
    assert len(images) == len(sizes)
    with torch.no_grad():
        theirs = hf_model(**inputs).logits[0, -1].numpy()
    assert rel_err(prefill(backend, ids, images, positions).prefill_logits, theirs) <= MAX_REL_ERR


def test_greedy_32_tokens_match_generate_and_decode_rotates_at_the_rope_delta(vl_dir, loaded, hf_model):
    """Every decode round's logits too: a round rotating at its KV position (delta 0) is off."""
    cfg, backend = loaded
    inputs = chat_inputs(vl_dir, [test_image(100, 70), test_image(60, 110, seed=1)], "Compare them.")
    ids, images, positions, delta = engine_inputs(cfg, inputs)
    assert delta < 0  # 16 + 7 placeholders take 4 + 4 positions
    with torch.no_grad():
        gen = hf_model.generate(**inputs, max_new_tokens=32, do_sample=False, output_logits=True,
                                return_dict_in_generate=True)  # fmt: skip
    their_tokens = gen.sequences[0, len(ids) :].tolist()
    out = prefill(backend, ids, images, positions)
    tokens = [out.prefill_token]
    for step in range(31):
        lane = DecodeLane(0, tokens[-1], len(ids) + step, TABLE, GREEDY, rope_delta=delta)
        got = StepOutput()
        backend.decode_round([lane], got)
        tokens.append(got.decode_tokens[0])
        if step < 4:  # (the lane's own run last: it rewrites the row's K/V as the round did)
            theirs = gen.logits[step + 1][0].numpy()
            unshifted = DecodeLane(0, lane.token_id, lane.position, TABLE, GREEDY)
            assert rel_err(backend.decode_logits([unshifted]), theirs) > MAX_REL_ERR
            assert rel_err(backend.decode_logits([lane]), theirs) <= MAX_REL_ERR
    assert tokens == their_tokens


def test_a_chunk_boundary_inside_an_image_gives_the_same_logits(vl_dir, loaded):
    cfg, backend = loaded
    inputs = chat_inputs(vl_dir, [test_image(100, 70), test_image(60, 110, seed=1)], "Compare them.")
    ids, images, positions, _ = engine_inputs(cfg, inputs)
    whole = prefill(backend, ids, images, positions).prefill_logits
    a, b = images
    cuts = [a.offset + 3, a.offset + 9, b.offset + 1, b.end + 2]  # inside a twice, inside b, after b
    chunked = prefill(backend, ids, images, positions, cuts).prefill_logits
    assert rel_err(chunked, whole) <= 1e-5


def test_the_tower_matches_transformers_on_windows_and_full_attention(vl_dir, loaded, hf_model):
    """A 112 x 112 image is 2 x 2 windows of 2 x 2 merge blocks: block 0 attends within each, block 1 over all."""
    cfg, backend = loaded
    inputs = chat_inputs(vl_dir, [test_image(112, 112)], "x")
    grid = tuple(inputs["image_grid_thw"][0].tolist())
    index, bounds = window_index(grid, cfg.vision)
    assert grid == (1, 8, 8) and bounds == [0, 16, 32, 48, 64] and sorted(index) == list(range(16))
    with torch.no_grad():
        theirs = hf_model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output[0]
    ours = backend.vision.encode(inputs["pixel_values"].numpy(), grid)
    assert rel_err(ours, theirs.numpy()) <= MAX_REL_ERR


def test_rope_index_is_transformers_get_rope_index(vl_dir, loaded, hf_model):
    cfg, _ = loaded
    inputs = chat_inputs(vl_dir, [test_image(100, 70), test_image(200, 30, seed=1)], "Compare them.")
    ids, images, positions, delta = engine_inputs(cfg, inputs)
    theirs, their_delta = hf_model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
    )
    assert positions.tolist() == theirs[:, 0].tolist() and delta == int(their_delta[0, 0])


def test_config_reads_both_layouts(vl_dir):
    """transformers 5's text_config, and the Hub's flat layout with rope_scaling's mrope_section."""
    new = json.loads((vl_dir / "config.json").read_text())
    d = definition("qwen2_5_vl")
    cfg = d.config_from_hf(new)
    flat = {k: v for k, v in new.items() if k != "text_config"}
    text = dict(new["text_config"])
    rope = text.pop("rope_parameters")
    flat.update(text, rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    assert d.config_from_hf(flat) == cfg
    assert cfg.params["mrope_section"] == (2, 3, 3) and cfg.vision.fullatt_block_indexes == (1,)
    assert cfg.vision.image_token_id == new["image_token_id"] and cfg.tie_word_embeddings
    bad = {
        **new,
        "text_config": {**new["text_config"], "rope_parameters": {"rope_theta": 1e4, "mrope_section": [4, 4, 4]}},
    }
    with pytest.raises(ValueError, match="mrope_section"):
        d.config_from_hf(bad)


def test_the_cuda_backend_takes_it_and_the_cpu_backend_falls_back(loaded):
    """The CUDA backend's run is tests/kernels/test_cuda_vl.py."""
    from engine.backends.cpu.model import check_supported as cpu_check
    from engine.backends.cuda.forward import check_model

    cfg, _ = loaded
    d = definition(cfg.arch)
    check_model(d.blocks(cfg), d.head(cfg), d.embedding(cfg))
    with pytest.raises(NotImplementedError, match="mrope"):  # engine/loading.py then loads numpy
        cpu_check(cfg, d.blocks(cfg), d.head(cfg))


def test_image_entries_are_checked_against_the_prompt_and_the_tower(vl_dir, loaded):
    cfg, _ = loaded
    inputs = chat_inputs(vl_dir, [test_image(100, 70)], "What is this?")
    ids = inputs["input_ids"][0].tolist()
    (entry,) = image_entries(inputs, cfg.vision.image_token_id)
    (img,) = check_images([entry], ids, cfg.vision)
    assert img.num_tokens == 8 and img.pixel_values.shape == (32, cfg.vision.patch_dim)
    bad = {
        "a text-only model": ([entry], ids, None),
        "short pixel bytes": ([{**entry, "pixel_values": entry["pixel_values"][:-4]}], ids, cfg.vision),
        "wrong token count": ([{**entry, "num_tokens": 7}], ids, cfg.vision),
        "unmergeable grid": ([{**entry, "grid_thw": [1, 3, 8]}], ids, cfg.vision),
        "offset off the placeholders": ([{**entry, "offset": entry["offset"] - 1}], ids, cfg.vision),
        "placeholders without an image": ([], ids, cfg.vision),
        "a malformed entry": ([{"hash": "x"}], ids, cfg.vision),
        "not a dict": (["image"], ids, cfg.vision),
    }
    for why, (raw, prompt, vision) in bad.items():
        with pytest.raises(ImageError):
            check_images(raw, prompt, vision)
            pytest.fail(why)
