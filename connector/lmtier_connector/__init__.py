"""Engine integrations: the paged-KV transfer engine, the vLLM connector and the
HF transformers adapter. They use what ``lmtier`` exports; the programs built on
them (demo, warm, cluster) are ``lmtier_apps``."""
