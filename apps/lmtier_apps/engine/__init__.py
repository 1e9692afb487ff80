"""``lmtier demo serve``: the demo engine (:mod:`.engine`) behind an OpenAI-compatible
HTTP API (:mod:`.serve`, :mod:`.openai_requests`, :mod:`.openai_api`)."""
