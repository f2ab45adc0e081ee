"""Qwen2.5-VL-7B-shaped on the CUDA backend: the vision tower's time for one 1,024 x 1,024 image and
the TTFT of a chat with it (issue 17).

The model: Qwen2.5-VL-7B-Instruct's config (LM: 28 layers, hidden 3584, 28 / 4 heads, inter 18944,
vocab 152064, mrope_section [16, 24, 24]; tower: depth 32, hidden 1280, 16 heads, inter 3420,
window 112, full attention in blocks 7 / 15 / 23 / 31, out_hidden 3584) with random weights drawn
on the device by torch (bf16, std 0.02, norms 1) and handed to the backend as tensors (copied
device to device). ``--layers`` builds fewer LM layers; the LM part of the TTFT is then scaled by
28 / layers (said in the table).

The image: 1,024 x 1,024 pixels are 1,036 x 1,036 after the processor's smart resize (multiples
of 28): 74 x 74 = 5,476 patches, 1,369 placeholder tokens. The chat: Qwen's template around it
(system turn, ``<|vision_start|>``, the placeholders, ``<|vision_end|>``, a short question,
the assistant header), 24 text tokens as random ids.

Times are wall clock with the stream synchronised, median of ``--reps`` runs after one warm-up:
the tower alone (``VisionTower.encode``: patches up from the host, rows back to it); the TTFT
(one ``PrefillSpan`` of the whole prompt with a greedy draw and its image not yet encoded, as a
request's first step: tower + LM prefill in 2,048-row chunks + the draw, at the backend: no HTTP,
no queue); the LM prefill alone (the same span with the rows already encoded); and the tower's
attention kernels alone (vis_attn_tc, the default, and the fp32 vis_attn) for a full-attention
and a window block (CUDA events).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np

from bench.perfdoc import command_line, report

SECTION = "## Qwen2.5-VL on the CUDA backend (H200, 7B shape, issue 17)"
LM_LAYERS = 28
GRID = (1, 74, 74)  # 1,024 x 1,024 -> 1,036 x 1,036 (round(1024 / 28) * 28) -> 74 x 74 patches
IMAGE_ID, START_ID, END_ID = 151655, 151652, 151653


def hf_config(layers: int) -> dict:
    return {
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": layers,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": False, "hidden_act": "silu", "image_token_id": IMAGE_ID, "video_token_id": 151656,
        "vision_start_token_id": START_ID,
        "vision_config": {
            "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584,
            "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "patch_size": 14, "spatial_merge_size": 2,
            "temporal_patch_size": 2, "in_channels": 3, "hidden_act": "silu",
        },
    }  # fmt: skip


def random_weights(defn, cfg) -> dict:
    """Every tensor of the definition, drawn on the device (bf16 matrices, fp32 biases, norms 1)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for name, shape in defn.tensors(cfg).items():
        if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")):
            out[name] = torch.ones(shape, dtype=torch.bfloat16, device="cuda")
        elif name.endswith(".bias"):
            out[name] = torch.randn(shape, generator=g, dtype=torch.float32, device="cuda") * 0.02
        else:
            out[name] = torch.randn(shape, generator=g, dtype=torch.bfloat16, device="cuda") * 0.02
    return out


def timed(fn, reps: int) -> float:
    ts = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=LM_LAYERS, help="LM layers to build (the LM time is scaled)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--write", action="store_true", help="replace this section of docs/PERFORMANCE.md")
    args = ap.parse_args()

    import pycuda.driver as cuda
    import torch

    from engine.backend import PrefillSpan, SampleRequest, StepOutput
    from engine.backends.cuda import CudaBackend
    from engine.cu import runtime
    from engine.models import definition
    from engine.models.vision import Image, rope_index
    from engine.sampling import SamplingParams

    defn = definition("qwen2_5_vl")
    cfg = defn.config_from_hf(hf_config(args.layers))
    t0 = time.perf_counter()
    weights = random_weights(defn, cfg)
    torch.cuda.synchronize()
    t_draw = time.perf_counter() - t0
    be = CudaBackend()
    t0 = time.perf_counter()
    be.load(cfg, weights, block_size=16, kv_budget_bytes=4 << 30, host_kv_budget_bytes=0, max_context=4096)
    t_load = time.perf_counter() - t0
    del weights
    torch.cuda.empty_cache()

    n_patch = int(np.prod(GRID))
    tokens = n_patch // 4
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((n_patch, cfg.vision.patch_dim)).astype(np.float32)
    head, tail = rng.integers(0, 150000, 15).tolist(), rng.integers(0, 150000, 9).tolist()
    ids = head + [START_ID] + [IMAGE_ID] * tokens + [END_ID] + tail
    img = Image("bench", len(head) + 1, tokens, GRID, pixels)
    positions, _delta = rope_index(len(ids), [img], cfg.vision.spatial_merge_size)
    table = list(range(-(-len(ids) // 16)))
    greedy = SampleRequest(params=SamplingParams(temperature=0), seed=0)

    def encode() -> None:
        with runtime.current():
            be.vision.encode(be.stream, pixels, GRID)

    def chat(fresh: bool):
        def run() -> None:
            if fresh:
                img.embeds = None
            be.prefill(PrefillSpan(0, ids, 0, table, sample=greedy, rope_positions=positions, images=[img]),
                       StepOutput())  # fmt: skip

        return run

    from engine.cu.vision import attention_tiles
    from engine.models.vision import frame_bounds, window_index

    vt, s = be.vision, be.stream
    vt.vk.tensor_cores = False
    t_tower_fp32 = timed(encode, args.reps)
    vt.vk.tensor_cores = True
    t_tower = timed(encode, args.reps)
    t_ttft = timed(chat(True), args.reps)
    t_lm = timed(chat(False), args.reps)
    attn = {}  # the attention kernels alone, over the q / k / v the last encode left
    with runtime.current():
        a, b = cuda.Event(), cuda.Event()
        for tc in (True, False):
            vt.vk.tensor_cores = tc
            for which in ("tiles_f", "tiles_w"):
                bounds = frame_bounds(GRID) if which == "tiles_f" else window_index(GRID, cfg.vision)[1]
                tiles = attention_tiles(bounds, vt.vk.query_rows)
                cuda.memcpy_htod(vt.ws[which], tiles)
                ts = []
                for _ in range(args.reps + 1):
                    a.record(s)
                    vt.vk.attention(s, vt.ws["q"], vt.ws["k"], vt.ws["v"], vt.ws[which], len(tiles), vt.ws["attn"],
                                    n_patch, cfg.vision.num_heads)  # fmt: skip
                    b.record(s)
                    b.synchronize()
                    ts.append(b.time_since(a) / 1e3)
                attn[which, tc] = statistics.median(ts[1:])
    be.unload()

    scale = LM_LAYERS / args.layers
    lm = t_lm * scale
    ttft = t_tower + lm if args.layers != LM_LAYERS else t_ttft
    v = cfg.vision
    flops_full = 4 * n_patch * n_patch * v.head_dim * v.num_heads
    gpu = torch.cuda.get_device_name(0)
    machine = f"{gpu}, {platform.node()}, torch {torch.__version__}"
    body = [
        "",
        f"Model: Qwen2.5-VL-7B shape, random bf16 weights drawn on the device ({t_draw:.1f} s), LM {args.layers} of "
        f"{LM_LAYERS} layers built{'' if scale == 1 else f' (LM time x {scale:.2f})'}; load {t_load:.1f} s. "
        f"Image 1,024 x 1,024 -> grid {list(GRID)}: {n_patch} patches, {tokens} placeholder tokens; prompt "
        f"{len(ids)} tokens. Wall clock, stream synchronised, median of {args.reps} after a warm-up.",
        "",
        "| measure | ms |",
        "|---|---|",
        f"| vision tower, one image (patches up, 32 blocks, merger, rows down) | {t_tower * 1e3:.1f} |",
        f"| ... with the fp32 attention kernel (vis_attn) instead | {t_tower_fp32 * 1e3:.1f} |",
        f"| LM prefill of the chat ({len(ids)} rows) + greedy draw, image rows already encoded | {lm * 1e3:.1f} |",
        f"| **TTFT of the chat** (one prefill span: tower + LM + draw) | {ttft * 1e3:.1f} |",
        *(
            f"| tower attention, one full-attention block ({name} over {n_patch} rows, "
            f"{flops_full / attn['tiles_f', tc] / 1e12:.1f} TFLOP/s) | {attn['tiles_f', tc] * 1e3:.2f} |"
            for tc, name in ((True, "vis_attn_tc"), (False, "vis_attn"))
        ),
        *(
            f"| tower attention, one window block ({name}, 64-row windows) | {attn['tiles_w', tc] * 1e3:.2f} |"
            for tc, name in ((True, "vis_attn_tc"), (False, "vis_attn"))
        ),
    ]
    report(SECTION, machine=machine, command=command_line("python3"), body=body, write=args.write)


if __name__ == "__main__":
    main()
