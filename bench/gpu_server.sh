#!/bin/bash
# The whole server on the GPU machine, in one device call: install the wheels
# carried in .whl (once), start `manage.py serve --model-backend cuda` on the
# default model, drive it with bench/gpu_server_check.py; logs under $OUT.
# The GGUF travels in pieces under .gpu/{a,b,c} (a call carries at most 64 MiB,
# and only /tmp outlives a call): `bash bench/gpu_server.sh stash` keeps the
# pieces a call carried in /tmp/parts until the last call assembles them.
# `bash bench/gpu_server.sh serving` runs bench/bench_serving_gpu.py (the 8B-shaped server, 1/8/12
# streams, async rounds on and off) instead of the check, its output under $OUT (and
# docs/PERFORMANCE.md written in the copy); it needs no GGUF: carry .whl and .gpu (the tokenizer,
# saved here first with `python3 bench/bench_serving_gpu.py --save-tokenizer`). The wheels in .whl
# must leave out what the machine has (huggingface_hub 2.x, filelock, fsspec: transformers there
# refused huggingface_hub 2.4 from /tmp/site; ../shared/device/README.md lists the rest).
set -o pipefail
export PYTHONUNBUFFERED=1 IGNIS_CUDA_KERNEL_CACHE_DIR=/tmp/pycuda-cache  # the cuda.kernel_cache_dir key
mkdir -p "$OUT"
mkdir -p /tmp/parts && cp .gpu/*/* /tmp/parts/ 2>/dev/null
[ "$1" = stash ] && { ls -l /tmp/parts; exit 0; }
if [ ! -f /tmp/ignis-site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ignis-site .whl/*.whl && touch /tmp/ignis-site/.done
fi
export PYTHONPATH=/tmp/ignis-site:$PWD
if [ "$1" = serving ]; then  # the tokenizer travels as .gpu/tokenizer (bench_serving_gpu.py --save-tokenizer)
  timeout 560 python3 bench/bench_serving_gpu.py --write --compare-async --server-log "$OUT/server.log" 2>&1 \
    | tee "$OUT/serving.log"
  cp docs/PERFORMANCE.md "$OUT/"
  exit 0
fi
gguf=models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$(dirname $gguf)"
[ -f "$gguf" ] || cat /tmp/parts/gguf.part-* > "$gguf"
sha256sum "$gguf" | tee "$OUT/gguf.sha256"
export IGNIS_SERVER_DATA_DIR=/tmp/ignis-var IGNIS_SERVER_CELERY_WORKER=false
python3 manage.py migrate --noinput -v 0 || exit 1
python3 manage.py serve --port 8080 --no-download --model-backend cuda --model-idle-unload 0 > "$OUT/server.log" 2>&1 &
pid=$!
for i in $(seq 1 240); do
  curl -sf http://127.0.0.1:8080/health > /dev/null && break
  kill -0 $pid 2>/dev/null || break
  sleep 0.5
done
curl -s http://127.0.0.1:8080/health > "$OUT/health.json"
timeout 300 python3 bench/gpu_server_check.py --base http://127.0.0.1:8080 --gguf "$gguf" --json "$OUT/report.json" \
  2>&1 | tee "$OUT/check.log"
kill $pid; wait $pid 2>/dev/null
tail -5 "$OUT/server.log"
