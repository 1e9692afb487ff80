"""``lmtier demo``: a small random Llama skipping its prefill through lmtier
(:mod:`.demo`), its model and byte tokenizer, the TTFT plot, and the command line of
``lmtier demo`` and ``lmtier demo serve`` (:mod:`.cli`)."""
