"""Engine integrations: the paged-KV transfer engine, the vLLM connector and the
HF transformers adapter. They sit on top of lmtier's StorageManager."""
