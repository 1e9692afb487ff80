#!/usr/bin/env bash
# Serve a model with vLLM (>= 0.33) and lmtier as its KV connector.
#   MODEL=meta-llama/Llama-3.1-8B-Instruct deploy/vllm/serve.sh [extra vllm args]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
model="${MODEL:?set MODEL to a model id or path}"
config="${LMTIER_CONFIG:-$here/lmtier.yaml}"
exec vllm serve "$model" \
  --block-size 16 \
  --kv-transfer-config "{\"kv_connector\":\"LMTierConnector\",
    \"kv_connector_module_path\":\"lmtier_connector.vllm\",
    \"kv_role\":\"kv_both\",
    \"kv_load_failure_policy\":\"recompute\",
    \"kv_connector_extra_config\":{\"config_path\":\"$config\",\"vllm_block_hashes\":true}}" \
  "$@"
