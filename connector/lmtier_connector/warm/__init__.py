"""``lmtier warm``: make prompts' KV cached before traffic arrives. :mod:`.inputs` reads
the prompts (JSONL, text files, directories, stdin) lazily and turns bad lines into
error records instead of stopping; :mod:`.via` sends them to a running OpenAI-compatible
engine with ``max_tokens=1`` so the engine saves its own KV; :mod:`.run` and :mod:`.cli`
compute the KV with a local model, store, pin and prefetch it, and report progress.
"""
