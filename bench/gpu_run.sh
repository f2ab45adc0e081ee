#!/bin/bash
# One device call: build check, GPU tests, benchmark; logs under $OUT.
# Usage (from the repo root on the GPU machine): bash bench/gpu_run.sh [tests|bench|all|suite|pdl|load|quant|gptoss|pair|burst|fp8|fp8gemm|next|spans]
#   suite: every GPU test under tests/kernels (~4 min on a warm kernel cache)
#   pdl:   cuda.pdl's card tests, then bench_cuda.py --pdl (the graph with it off / on)
#   load:  the pinned uploader's card tests, bench_load.py --write, and the loop's gaps during an
#          8B bf16 load on the card (bench_load_beats.py, on bench_load.py's 16 GB checkpoint)
#   gptoss: MXFP4 checks (tests/kernels/test_cuda_moe_mxfp4.py), the MoE layers alone (bench_moe_mx.py, both
#          prefill paths, then the split down build) and the whole gpt-oss-20b shape (bench_gpt_oss.py --bf16)
#   pair:  gemv_pair.cu's wide variants (CudaTuning.gemv_pair): their card tests (bitwise against
#          gemv_tc, with gemv_wide's), then bench_verify.py --wide (the GEMVs alone and the verify rounds)
#   burst: issue 15's burst of 8 short prompts through the real server (bench_serving_gpu.py, 1 and 8
#          streams of 128 tokens, after a warm-up burst) with cuda.known_rows 0, then 64, then 64 with
#          cuda.gemv_pair off; needs .gpu/tokenizer (bench_serving_gpu.py --save-tokenizer) and the
#          openai client's wheels in .whl, both carried
#   next:  what stop 35 left unmeasured (~3 min; carry .whl with the openai wheels and .gpu): the serving
#          bench at the server's new defaults (cuda.known_rows 64, model.short_prefill 16, prefill passes
#          at cuda.round_rows' GEMV cap: docs/PERFORMANCE.md, "Where a burst's first tokens wait"), then
#          with known_rows 0, 1 / 8 / 12 streams with the TTFT split; then the prefill-group card tests
#   spans: what stop 38 left unmeasured (~8 min; carry .whl with the openai wheels and .gpu): the card tests
#          of prefill_attn_hopper_spans and the prefill groups (cuda.attention_spans: turn its default on when
#          they pass), then the serving bench with the collector's pauses timed (--gc-probe) and the prefill
#          steps' host share read from the log, as the tree is, with cuda.attention_spans on, with a 500 us
#          switch interval and with 4 front ends
#   fp8gemm: the fp8 prefill GEMM (cuda.fp8_gemm): its card tests, then bench_fp8_gemm.py (the 8B GEMMs
#          alone, then the 8B shape's prefill, FP8_LAYERS deep (16), with it off and on, and bf16 beside); ~2 min
#   fp8:   both fp8 kinds (per channel: FP8; 128 x 128 tiles: FP8B): their card tests, then bench_fp8.py
#   quant: the kernel experiments of 2026-12-06 still in the tree (docs/QUANT.md, "The stage loop"): the
#          quantized GEMV with less shared memory preferred (--carveout); decode attention alone with the
#          next sub-chunk prefetched (DECODE_PIPE) and with 64 / 128 splits; then the Q4_K_M / Q8_0 rounds
set -o pipefail
what=${1:-all}
# Kernels compile into models/.cache/pycuda (the default; tests and bench alike).
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
# PyCUDA's own SourceModule (bench_moe_mx.py's fill kernel) writes into PYCUDA_CACHE_DIR without creating it
[ -n "${PYCUDA_CACHE_DIR:-}" ] && mkdir -p "$PYCUDA_CACHE_DIR"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv > "$OUT/machine.txt" 2>&1
python3 -c "import pycuda, cuda.bindings, torch, transformers; print(pycuda.VERSION, torch.__version__, transformers.__version__)" >> "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 200 python3 -m pytest -p no:cacheprovider -q -o addopts="" tests/kernels/test_cuda_kernels.py 2>&1 | tee "$OUT/test_kernels.log" | tail -40
  timeout 240 python3 -m pytest -p no:cacheprovider -q -o addopts="" tests/kernels/test_cuda_model.py 2>&1 | tee "$OUT/test_model.log" | tail -40
fi
if [ "$what" = suite ]; then
  timeout 540 python3 -m pytest -p no:cacheprovider -q -o addopts="" tests/kernels 2>&1 | tee "$OUT/suite.log" \
    | grep -E "passed|failed|FAILED|ERROR" | tail -40
fi
if [ "$what" = pdl ]; then
  timeout 200 python3 -m pytest -p no:cacheprovider -q -o addopts="" tests/kernels/test_cuda_pdl.py 2>&1 \
    | tee "$OUT/test_pdl.log" | tail -20
  timeout 300 python3 bench/bench_cuda.py --pdl --skip-hf 2>&1 | tee "$OUT/bench_pdl.log" | tail -20
fi
if [ "$what" = load ]; then
  timeout 150 python3 -m pytest -p no:cacheprovider -q -o addopts="" tests/kernels/test_cuda_upload_host.py \
    tests/kernels/test_cuda_bf16_load.py 2>&1 | tee "$OUT/test_upload.log" | tail -20
  timeout 250 python3 bench/bench_load.py --write 2>&1 | tee "$OUT/bench_load.log" | tail -20
  timeout 150 python3 bench/bench_load_beats.py --case bf16 --layers 32 --backend cuda --cold --dir /tmp/ignis-load-8b \
    --trace "$OUT/beats_trace.txt" 2>&1 | tee "$OUT/beats.log" | tail -5
  cp docs/PERFORMANCE.md "$OUT/" 2>/dev/null
fi
if [ "$what" = quant ]; then
  for c in 75 50; do
    timeout 60 python3 bench/quant_probe.py --formats Q4_K --tunings "" --carveout $c 2>&1 | tee "$OUT/probe_carve$c.log" | tail -7
  done
  timeout 90 python3 bench/attn_probe.py --variant pipe=DECODE_PIPE=1 s64=NUM_SPLITS=64 s128=NUM_SPLITS=128 2>&1 \
    | tee "$OUT/attn.log" | tail -11
  timeout 150 python3 bench/bench_quant.py --synthetic Q4_K_M Q8_0 2>&1 | tee "$OUT/bench_quant.log" | tail -6
fi
if [ "$what" = pair ]; then
  timeout 240 python3 -m pytest -p no:cacheprovider -q -o addopts="" tests/kernels/test_cuda_gemv_wide.py \
    tests/kernels/test_cuda_attention_lanes.py 2>&1 \
    | tee "$OUT/test_pair.log" | tail -8
  timeout 300 python3 bench/bench_verify.py --wide --rounds 20 2>&1 | tee "$OUT/verify_wide.log" | tail -32
fi
if [ "$what" = burst ]; then
  for run in "0 on" "64 on" "64 off"; do
    set -- $run
    IGNIS_CUDA_KNOWN_ROWS=$1 IGNIS_CUDA_GEMV_PAIR=$2 timeout 200 python3 \
      bench/bench_serving_gpu.py --streams 1,8 --tokens 128 --label "known_rows $1, gemv_pair $2" \
      --server-log "$OUT/server_$1_$2.log" 2>&1 | tee "$OUT/burst_$1_$2.log" | tail -6
  done
fi
if [ "$what" = fp8 ]; then
  timeout 200 python3 -m pytest -p no:cacheprovider -q -o addopts="" tests/kernels/test_cuda_fp8.py 2>&1 \
    | tee "$OUT/test_fp8.log" | tail -8
  timeout 120 python3 bench/bench_fp8.py 2>&1 | tee "$OUT/bench_fp8.log" | tail -6
fi
if [ "$what" = fp8gemm ]; then
  timeout 130 python3 -m pytest -p no:cacheprovider -q -o addopts="" tests/kernels/test_cuda_fp8_gemm.py 2>&1 \
    | tee "$OUT/test_fp8_gemm.log" | tail -15
  timeout 70 python3 bench/bench_fp8_gemm.py --skip-model 2>&1 | tee "$OUT/fp8_gemms.log" | tail -22
  timeout 200 python3 bench/bench_fp8_gemm.py --model-only --layers ${FP8_LAYERS:-16} 2>&1 | tee "$OUT/fp8_model.log" | tail -12
fi
if [ "$what" = gptoss ]; then
  timeout 240 python3 -m pytest -p no:cacheprovider -q -o addopts="" tests/kernels/test_cuda_moe_mxfp4.py 2>&1 \
    | tee "$OUT/test_mxfp4.log" | tail -15
  timeout 120 python3 bench/bench_moe_mx.py --breakdown 2>&1 | tee "$OUT/moe_mx.log" | tail -24
  timeout 90 python3 bench/bench_moe_mx.py --prefill-rows --define MX_U=1 MX_DOWN_SPLIT=1 2>&1 \
    | tee "$OUT/moe_mx_split.log" | tail -10
  timeout 300 python3 bench/bench_gpt_oss.py --bf16 --write 2>&1 | tee "$OUT/gpt_oss.log" | tail -10
  cp docs/PERFORMANCE.md "$OUT/" 2>/dev/null
fi
if [ "$what" = next ]; then
  for kr in 64 0; do
    IGNIS_CUDA_KNOWN_ROWS=$kr timeout 120 python3 bench/bench_serving_gpu.py --streams 1,8,12 --tokens 64 \
      --label "known_rows $kr" --server-log "$OUT/server_kr$kr.log" 2>&1 | tee "$OUT/serving_kr$kr.log" \
      | grep -E "Burst|TTFT split|\| known"
  done
  timeout 200 python3 -m pytest -p no:cacheprovider -q -o addopts="" tests/kernels/test_cuda_prefill_group.py 2>&1 \
    | tee "$OUT/test_group.log" | tail -5
fi
if [ "$what" = spans ]; then
  timeout 240 python3 -m pytest -p no:cacheprovider -q -o addopts="" tests/kernels/test_cuda_attention_hopper.py \
    tests/kernels/test_cuda_prefill_group.py 2>&1 | tee "$OUT/test_spans.log" | tail -5
  for run in "tree" "spans --cuda-attention-spans true" "sw500 --server-switch-interval-us 500" \
             "fe4 --server-front-ends 4"; do
    set -- $run
    label=$1; shift
    timeout 120 python3 bench/bench_serving_gpu.py --streams 1,8,12 --tokens 64 --gc-probe --label "$label" \
      --server-log "$OUT/server_$label.log" -- "$@" 2>&1 | tee "$OUT/serving_$label.log" \
      | grep -E "Burst|TTFT split|Garbage|\| $label"
  done
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout ${BENCH_TIMEOUT:-300} python3 bench/bench_cuda.py --write ${BENCH_ARGS} 2>&1 | tee "$OUT/bench.log" | tail -30
  cp docs/PERFORMANCE.md "$OUT/" 2>/dev/null
fi
