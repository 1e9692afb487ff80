"""KV in device memory: the paged KV cache an engine keeps, the transfer engine that
moves chunks in and out of its pages (CUDA streams when present), and the device
prefix-cache tier with its block pool, modelled on vLLM's."""
