#!/usr/bin/env bash
# GPU check for the AgentKV vLLM connector (not part of CI; needs an NVIDIA GPU, ~5-8 minutes).
#
#   scripts/gpu_check.sh                      # MODEL defaults to a small instruct model
#   MODEL=/models/llama-3.2-1b scripts/gpu_check.sh
#
# 1. installs the pinned CUDA vLLM (vllm==0.32.0, the connector's pin) into .venv-gpu and the
#    daemon into .venv (make setup); offline machines: set PIP_FIND_LINKS to a wheelhouse;
# 2. serves MODEL twice with a deliberately small GPU KV pool (--num-gpu-blocks-override) and the
#    same host tier: vLLM's own OffloadingConnector (LRU, store everything: the default), then
#    AgentKVConnector talking to `policyd serve`;
# 3. replays the same agent workload against each (python -m connector.replay --server) and
#    prints hit / recomputed prompt tokens and throughput side by side.
# Every step is bounded by `timeout`; logs land in $OUT (default ./gpu-check-out).
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
GPU_VENV=${GPU_VENV:-.venv-gpu}
OUT=${OUT:-gpu-check-out}
GPU_BLOCKS=${GPU_BLOCKS:-256}            # 16-token blocks: ~4k tokens, so the workload spills
HOST_BYTES=${HOST_BYTES:-4000000000}
WORKFLOWS=${WORKFLOWS:-24}
CONCURRENCY=${CONCURRENCY:-8}
PORT=${PORT:-8011}
mkdir -p "$OUT"
t0=$(date +%s)
say() { echo "[gpu_check +$(( $(date +%s) - t0 ))s] $*"; }

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || { echo "no NVIDIA GPU"; exit 2; }

say "installing vllm==$VLLM_VERSION into $GPU_VENV"
if [ ! -x "$GPU_VENV/bin/vllm" ]; then
  python3 -m venv "$GPU_VENV"
  timeout 300 "$GPU_VENV/bin/pip" install -q "vllm==$VLLM_VERSION"
fi
timeout 120 "$GPU_VENV/bin/pip" install -q --no-deps -e .
timeout 300 make setup >/dev/null

serve() {  # serve LABEL KV_TRANSFER_CONFIG_JSON
  local label=$1 cfg=$2
  say "starting vLLM ($label)"
  timeout 900 "$GPU_VENV/bin/vllm" serve "$MODEL" --port "$PORT" --served-model-name model \
    --num-gpu-blocks-override "$GPU_BLOCKS" --max-model-len 2048 --enable-prompt-tokens-details \
    --kv-transfer-config "$cfg" >"$OUT/vllm-$label.log" 2>&1 &
  VLLM_PID=$!
  for _ in $(seq 1 180); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && { say "vLLM ($label) healthy"; return 0; }
    kill -0 "$VLLM_PID" 2>/dev/null || { tail -50 "$OUT/vllm-$label.log"; exit 1; }
    sleep 2
  done
  echo "vLLM ($label) did not become healthy"; tail -50 "$OUT/vllm-$label.log"; exit 1
}
stop_vllm() { kill "$VLLM_PID" 2>/dev/null || true; wait "$VLLM_PID" 2>/dev/null || true; }
replay() {  # replay LABEL
  timeout 300 "$GPU_VENV/bin/python" -m connector.replay --server "http://127.0.0.1:$PORT" \
    --model model --label "$1" --workflows "$WORKFLOWS" --concurrency "$CONCURRENCY" \
    --vocab 20000 --json "$OUT/$1.json"
}

serve vllm-default "{\"kv_connector\": \"OffloadingConnector\", \"kv_role\": \"kv_both\", \"kv_connector_extra_config\": {\"cpu_bytes_to_use\": $HOST_BYTES}}"
replay vllm-default
stop_vllm

say "starting policyd serve"
.venv/bin/policyd serve --db "$OUT/history.duckdb" --events tcp://127.0.0.1:5557 \
  --snapshots tcp://127.0.0.1:5558 --http-port 8470 --policy agentkv --gpu-blocks "$GPU_BLOCKS" \
  >"$OUT/policyd.log" 2>&1 &
POLICYD_PID=$!
trap 'stop_vllm; kill $POLICYD_PID 2>/dev/null || true' EXIT
for _ in $(seq 1 60); do curl -sf http://127.0.0.1:8470/readyz >/dev/null && break; sleep 1; done

serve agentkv "{\"kv_connector\": \"AgentKVConnector\", \"kv_connector_module_path\": \"connector.vllm_adapter\", \"kv_role\": \"kv_both\", \"kv_connector_extra_config\": {\"cpu_bytes_to_use\": $HOST_BYTES, \"agentkv_events_endpoint\": \"tcp://127.0.0.1:5557\", \"agentkv_snapshot_endpoint\": \"tcp://127.0.0.1:5558\"}}"
replay agentkv
stop_vllm

say "results (hit / recomputed prompt tokens, throughput)"
"$GPU_VENV/bin/python" -m connector.replay --table "$OUT/vllm-default.json" "$OUT/agentkv.json"
curl -sf http://127.0.0.1:8470/api/stats | "$GPU_VENV/bin/python" -m json.tool | head -40 || true
say "done"
