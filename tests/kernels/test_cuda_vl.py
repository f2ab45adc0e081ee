"""qwen2_5_vl on the CUDA backend: multimodal rope, the vision tower on the device, images in prefill.

A small random Qwen2.5-VL checkpoint in shapes the kernels take (transformers' own class,
``save_pretrained``; text hidden 256 with head_dim 64 and mrope_section [8, 12, 12]; a tower of
depth 3, hidden 64 in 2 heads, windows of 2 x 2 merge blocks, block 1 full attention, an MLP
width of 100 that the device tower pads to 104), fed random patches with the placeholders where
transformers' ``get_rope_index`` expects them (after a vision-start token). Checked: last-position
logits within cosine 0.999 of transformers (float32, CPU) with one, two, a large and no image,
and with an image across the backend's 2,048-row chunk; the device tower against the numpy
tower; a span boundary inside an image; greedy decode (rotating at the rope delta) equal to the
numpy backend until a near-tie. Skipped without a device.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.kernels.gpu import requires_cuda

pytestmark = [*requires_cuda, pytest.mark.slow]

VOCAB, START, END, IMAGE, VIDEO = 512, 506, 507, 508, 509
TEXT = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=0.02,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]})  # fmt: skip
VISION = dict(depth=3, hidden_size=64, intermediate_size=100, num_heads=2, in_channels=3, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2, tokens_per_second=2, window_size=56, out_hidden_size=256,
              fullatt_block_indexes=[1], initializer_range=0.02)  # fmt: skip
BLOCK = 16


def build(path):
    """Write the checkpoint to ``path``; return transformers' float32 model of it."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE, video_token_id=VIDEO,
                              vision_start_token_id=START, vision_end_token_id=END, tie_word_embeddings=False)  # fmt: skip
    model = tf.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # norms around 1 and biases non-zero, so a swapped or missing one shows
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")):
                p.normal_(1.0, 0.1)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.05)
            p.copy_(p.to(torch.bfloat16).float())  # the weights a bf16 checkpoint holds, on both sides
    model.save_pretrained(path)
    (path / "generation_config.json").unlink(missing_ok=True)
    return model


def prompt(grids, text_lens, seed=0):
    """(ids, pixel_values, grids): text runs around ``<start> <image>*k <end>`` per grid (t, h, w)."""
    rng = np.random.default_rng(seed)
    ids, pixels = rng.integers(3, 500, text_lens[0]).tolist(), []
    for grid, n in zip(grids, text_lens[1:]):
        patches = int(np.prod(grid))
        ids += [START] + [IMAGE] * (patches // 4) + [END] + rng.integers(3, 500, n).tolist()
        pixels.append(rng.standard_normal((patches, 1176)).astype(np.float32))
    return ids, pixels, [list(g) for g in grids]


def engine_images(cfg, ids, pixels, grids):
    """(images, rope positions or None, rope delta) as the scheduler holds them."""
    from engine.models.vision import check_images, rope_index

    entries, pos = [], 0
    for pv, grid in zip(pixels, grids):
        off = ids.index(IMAGE, pos)
        entries.append({"hash": str(off), "offset": off, "num_tokens": len(pv) // 4, "grid_thw": grid,
                        "pixel_values": pv.tobytes()})  # fmt: skip
        pos = off + len(pv) // 4
    images = check_images(entries, ids, cfg.vision)
    if not images:
        return images, None, 0
    positions, delta = rope_index(len(ids), images, cfg.vision.spatial_merge_size)
    return images, positions, delta


def hf_logits(model, ids, pixels, grids):
    import torch

    kw = {"input_ids": torch.tensor([ids])}
    if pixels:
        kw.update(pixel_values=torch.tensor(np.concatenate(pixels)), image_grid_thw=torch.tensor(grids),
                  mm_token_type_ids=(torch.tensor([ids]) == IMAGE).int())  # fmt: skip
    with torch.no_grad():
        return model(**kw).logits[0, -1].float().numpy()


def prefill(be, ids, images, positions, cuts=(), sample=None):
    """The prompt in spans cut at ``cuts``; returns the last span's StepOutput (its logits)."""
    from engine.backend import PrefillSpan, StepOutput

    bounds = [0, *cuts, len(ids)]
    table = list(range(-(-len(ids) // BLOCK) + 4))
    for img in images:
        img.embeds = None
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        out = StepOutput()
        last = hi == len(ids)
        be.prefill(PrefillSpan(0, ids[lo:hi], lo, table, sample=sample if last else None, want_logits=last,
                               rope_positions=None if positions is None else positions[:, lo:hi],
                               images=[im for im in images if im.offset < hi and im.end > lo]), out)  # fmt: skip
    return out


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    from engine.backends import create_backend
    from engine.loaders import load_artifact

    path = tmp_path_factory.mktemp("tiny_vl_cuda")
    model = build(path)
    cfg, weights = load_artifact(path)
    assert cfg.arch == "qwen2_5_vl"
    be = create_backend("cuda")
    be.load(cfg, weights, block_size=BLOCK, kv_budget_bytes=256 << 20, host_kv_budget_bytes=0, max_context=4096)
    ref = create_backend("numpy")
    ref.load(cfg, weights, block_size=BLOCK, kv_budget_bytes=128 << 20, host_kv_budget_bytes=0, max_context=4096)
    yield model, cfg, be, ref
    be.unload()
    ref.unload()


CASES = {
    "one image": ([(1, 8, 12)], [7, 9]),
    "two images, partial windows": ([(1, 8, 12), (1, 10, 6)], [5, 3, 11]),
    "a large image (full attention over 560 patches)": ([(1, 20, 28)], [4, 6]),
    "an image across the 2,048-row chunk": ([(1, 20, 28)], [1990, 12]),
    "text only": ([], [40]),
}


@pytest.mark.parametrize("case", CASES)
def test_last_position_logits_match_transformers(case, vl):
    model, cfg, be, _ = vl
    ids, pixels, grids = prompt(*CASES[case])
    images, positions, _ = engine_images(cfg, ids, pixels, grids)
    got = prefill(be, ids, images, positions).prefill_logits
    want = hf_logits(model, ids, pixels, grids)
    assert cosine(got, want) >= 0.999, (case, cosine(got, want))


@pytest.mark.parametrize("tensor_cores", [True, False])
@pytest.mark.parametrize("grid", [(1, 8, 12), (1, 10, 6), (1, 20, 28), (2, 4, 4)])
def test_the_device_tower_matches_the_numpy_tower(grid, tensor_cores, vl):
    """With either attention kernel (vis_attn_tc, the default, or the fp32 vis_attn)."""
    from engine.cu import runtime

    _, cfg, be, ref = vl
    pixels = np.random.default_rng(sum(grid)).standard_normal((int(np.prod(grid)), 1176)).astype(np.float32)
    be.vision.vk.tensor_cores = tensor_cores
    try:
        with runtime.current():
            ours = be.vision.encode(be.stream, pixels, grid)
    finally:
        be.vision.vk.tensor_cores = True
    theirs = ref.vision.encode(pixels, grid)
    assert ours.shape == theirs.shape == (np.prod(grid) // 4, cfg.hidden_size)
    rows = [cosine(a, b) for a, b in zip(ours, theirs)]  # a row out of place shows in its own cosine
    assert min(rows) >= 0.995 and cosine(ours, theirs) >= 0.999, (min(rows), cosine(ours, theirs))


def test_a_span_boundary_inside_an_image_gives_the_same_logits(vl):
    _, cfg, be, _ = vl
    ids, pixels, grids = prompt([(1, 8, 12), (1, 10, 6)], [5, 3, 11])
    images, positions, _ = engine_images(cfg, ids, pixels, grids)
    whole = prefill(be, ids, images, positions).prefill_logits
    a, b = images
    cuts = [a.offset + 3, a.offset + 17, b.offset + 1, b.end + 2]  # inside a twice, inside b, after b
    chunked = prefill(be, ids, images, positions, cuts).prefill_logits
    assert cosine(chunked, whole) >= 0.9999 and np.argmax(chunked) == np.argmax(whole)


def _greedy_run(be, seqs, steps, tables):
    """Greedy continuations of ``seqs`` [(ids, images, positions, delta)], decoded as one round of
    all lanes a step; with ``be`` the numpy backend also each step's logits (lane -> list)."""
    from engine.backend import DecodeLane, SampleRequest
    from engine.backends.numpy import NumpyBackend
    from engine.sampling import SamplingParams

    greedy = SampleRequest(params=SamplingParams(temperature=0), seed=0)
    is_ref = isinstance(be, NumpyBackend)
    toks, logits = [], [[] for _ in seqs]
    for i, (ids, images, positions, _) in enumerate(seqs):
        from engine.backend import PrefillSpan, StepOutput

        for img in images:
            img.embeds = None
        out = StepOutput()
        be.prefill(PrefillSpan(i, ids, 0, tables[i], sample=greedy, want_logits=is_ref, rope_positions=positions,
                               images=images), out)  # fmt: skip
        toks.append([out.prefill_token])
        if is_ref:
            logits[i].append(out.prefill_logits)
    for step in range(steps):
        lanes = [DecodeLane(i, toks[i][-1], len(s[0]) + step, tables[i], greedy, rope_delta=s[3])
                 for i, s in enumerate(seqs)]  # fmt: skip
        if is_ref:
            for i, row in enumerate(be.decode_logits(lanes)):
                logits[i].append(row)
                toks[i].append(int(np.argmax(row)))
            continue
        from engine.backend import StepOutput

        out = StepOutput()
        be.decode_round(lanes, out)
        for i, t in enumerate(out.decode_tokens):
            toks[i].append(t)
    return toks, logits


def test_greedy_decode_rotates_at_the_rope_delta_as_numpy_does(vl):
    """Lanes with images (negative rope deltas) and a text-only one share each round."""
    _, cfg, be, ref = vl
    seqs = []
    for seed, (grids, lens) in enumerate([([(1, 8, 12)], [7, 9]), ([(1, 10, 6), (1, 4, 8)], [3, 5, 2]),
                                          ([], [30])]):  # fmt: skip
        ids, pixels, g = prompt(grids, lens, seed=seed)
        seqs.append((ids, *engine_images(cfg, ids, pixels, g)))
    assert seqs[0][3] < 0 and seqs[1][3] < 0 and seqs[2][3] == 0
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(len(seqs))]
    steps = 16
    cuda_toks, _ = _greedy_run(be, seqs, steps, tables)
    np_toks, np_logits = _greedy_run(ref, seqs, steps, tables)
    for i, (a, b) in enumerate(zip(np_toks, cuda_toks)):
        if a == b:
            continue
        j = next(k for k in range(len(a)) if a[k] != b[k])
        top = np.sort(np_logits[i][j])[::-1]
        assert top[0] - top[1] <= 0.02 * abs(top[0]), f"lane {i} diverged at {j} without a near-tie"


# --- the kernels alone, against numpy on fresh random inputs -------------------------------


@pytest.fixture(scope="module")
def dev():
    from engine.cu import runtime

    with runtime.current():
        import pycuda.driver as cuda

        yield cuda, cuda.Stream()


def _rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("tensor_cores", [True, False])
@pytest.mark.parametrize("d", [32, 80, 128])
def test_vis_qkv_rope_and_vis_attn_match_numpy(dev, d, tensor_cores):
    """Segments of odd lengths (one row, partial key chunks, several chunks and query tiles), heads
    head-major; vis_attn_tc (64-row tiles, 64-key chunks) and vis_attn (32, 32)."""
    import pycuda.gpuarray as ga

    from engine.backends.cuda.weights import from_bf16
    from engine.cu.vision import VisionKernels, attention_tiles

    _, s = dev
    vk, heads, bounds = VisionKernels(d, tensor_cores=tensor_cores), 3, [0, 1, 17, 49, 50, 161]
    rng = np.random.default_rng(d)
    n = bounds[-1]
    qkv = rng.standard_normal((n, 3, heads, d)).astype(np.float32)
    hw = rng.integers(0, 40, (n, 2)).astype(np.int32)
    inv = (1.0 / 10000.0 ** (np.arange(0, d // 2, 2, dtype=np.float32) / (d // 2))).astype(np.float32)
    g = {name: ga.to_gpu(a) for name, a in {"qkv": qkv, "hw": hw, "inv": inv}.items()}
    for name in "qkv":
        g[name + "_out"] = ga.zeros(heads * n * d, np.uint16)
    tiles = attention_tiles(bounds, vk.query_rows)
    g["tiles"], g["out"] = ga.to_gpu(tiles), ga.zeros(n * heads * d, np.uint16)
    vk.qkv_rope(s, g["qkv"].ptr, g["hw"].ptr, g["inv"].ptr, g["q_out"].ptr, g["k_out"].ptr, g["v_out"].ptr, n, heads)
    vk.attention(s, g["q_out"].ptr, g["k_out"].ptr, g["v_out"].ptr, g["tiles"].ptr, len(tiles), g["out"].ptr, n,
                 heads)  # fmt: skip
    s.synchronize()
    ang = np.concatenate([hw[:, :1] * inv, hw[:, 1:] * inv], axis=1)  # [n, d/2]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rot(x):
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    want = {"q": rot(qkv[:, 0]), "k": rot(qkv[:, 1]), "v": qkv[:, 2]}
    got = {x: from_bf16(g[x + "_out"].get()).reshape(heads, n, d).transpose(1, 0, 2) for x in "qkv"}
    for x in "qkv":
        assert _rel(got[x], want[x]) < 8e-3, x
    q, k, v = (got[x].astype(np.float64) for x in "qkv")
    ref = np.empty((n, heads, d))
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        sc = np.einsum("nhd,thd->hnt", q[lo:hi], k[lo:hi]) / np.sqrt(d)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        ref[lo:hi] = np.einsum("hnt,thd->nhd", p / p.sum(-1, keepdims=True), v[lo:hi])
    out = from_bf16(g["out"].get()).reshape(n, heads, d)
    assert _rel(out, ref) < 1e-2


def test_rope_kv_write_with_multimodal_positions(dev):
    """Three positions a row; pairs rotate by t, h, w in mrope_section's runs (rope.cu)."""
    import pycuda.gpuarray as ga

    from engine.backends.cuda.weights import from_bf16
    from engine.backends.numpy.ops import mrope_cos_sin, rope_neox
    from engine.cu.kernels import Kernels

    _, s = dev
    d, kvh, h, rows, bs, section = 64, 2, 4, 9, 16, (8, 12, 12)
    k = Kernels(d, h // kvh)
    rng = np.random.default_rng(7)
    qkv = rng.standard_normal((rows, (h + 2 * kvh) * d)).astype(np.float32)
    pos = rng.integers(0, 3000, (3, rows)).astype(np.int32)
    slots = np.arange(rows, dtype=np.int32) + 5
    inv = (1.0 / 1e6 ** (np.arange(0, d, 2, dtype=np.float32) / d)).astype(np.float32)
    cache = ga.zeros(4 * 2 * bs * kvh * d, np.uint16)
    q_out = ga.zeros(rows * h * d, np.uint16)
    g = [ga.to_gpu(a) for a in (qkv, np.ascontiguousarray(pos.T), slots, inv)]  # alive until the kernel ran
    k.rope_kv_write(s, g[0].ptr, g[1].ptr, g[2].ptr, g[3].ptr, q_out.ptr, cache.ptr, rows, h, kvh, bs,
                    2 * bs * kvh * d, mrope=(section[0], section[0] + section[1]))  # fmt: skip
    s.synchronize()
    cos, sin = mrope_cos_sin(pos.astype(np.int64), inv, section)
    x = qkv.reshape(rows, h + 2 * kvh, d)
    assert _rel(from_bf16(q_out.get()).reshape(rows, h, d), rope_neox(x[:, :h], cos, sin)) < 8e-3
    c = from_bf16(cache.get()).reshape(4, 2, bs, kvh, d)  # one layer: [blocks][K, V][slot][kvh][d]
    assert _rel(c[slots // bs, 0, slots % bs], rope_neox(x[:, h : h + kvh], cos, sin)) < 8e-3
