"""``lmtier warm``: make prompts' KV cached before traffic arrives. :mod:`.inputs` reads
the prompts (JSONL, text files, directories, stdin) lazily and boundedly and turns bad
lines into error records instead of stopping; :mod:`.via` sends them to a running
OpenAI-compatible engine with ``max_tokens=1`` so the engine saves its own KV;
:mod:`.model` names the model from its files and loads its tokenizer and weights only
when a prompt needs them; :mod:`.run` (the loop), :mod:`.local` (the cache it runs
into), :mod:`.compute` (the prefill), :mod:`.interrupt` (Ctrl-C) and :mod:`.command`
store, pin and prefetch the KV, and :mod:`.progress` reports it.
"""
