#!/usr/bin/env bash
# The fleet's load run (issue 18): guidellm against two workers serving one model behind one
# front end, on Redis and PostgreSQL, offline (synthetic prompts, the tokenizer from a local
# directory). Results: docs/PERFORMANCE.md ("A fleet on Redis").
#
#   bench/fleet_load.sh                   # cpu backend, the default GGUF on both workers
#   BACKEND=numpy STREAMS=1,4,8 SECONDS_EACH=30 bench/fleet_load.sh
#
# guidellm goes into its own virtual environment (LOAD_VENV, default /tmp/ignis-load-venv):
# it pins versions of its own that the server's .venv need not share.
set -euo pipefail
cd "$(dirname "$0")/.."
LOAD_VENV=${LOAD_VENV:-/tmp/ignis-load-venv}
BACKEND=${BACKEND:-cpu}
STREAMS=${STREAMS:-1,4,8}
SECONDS_EACH=${SECONDS_EACH:-60}
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-64}
OUT=${OUT:-/tmp/ignis-fleet-load}
if [ ! -x "$LOAD_VENV/bin/guidellm" ]; then
  python3 -m venv "$LOAD_VENV"
  "$LOAD_VENV/bin/pip" install -q guidellm==0.8.1
fi
mkdir -p "$OUT"
echo "machine: $(uname -n) $(uname -m) $(nproc) cores; date: $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "command: BACKEND=$BACKEND STREAMS=$STREAMS SECONDS_EACH=$SECONDS_EACH bench/fleet_load.sh"
# HF_HUB_OFFLINE: nothing is fetched; the tokenizer is the local directory fleet_soak.py hands over.
exec .venv/bin/python bench/fleet_soak.py --backend "$BACKEND" --gguf --exec "
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $LOAD_VENV/bin/guidellm run \
    --backend kind=openai_http,target=\$IGNIS_FLEET_URL,model=smollm2-135m-instruct \
    --tokenizer kind=hf_auto,model=\$IGNIS_FLEET_TOKENIZER \
    --data kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS \
    --profile kind=concurrent,streams=1 --override profile.streams $STREAMS \
    --constraint kind=max_duration,seconds=$SECONDS_EACH \
    --output kind=json,path=$OUT/benchmarks.json --output kind=console \
    --disable-console-interactive"
