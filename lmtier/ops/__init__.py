"""Operating a cache: the ``lmtier`` commands that look at what is cached and why.

One module per command, each registered through the ``lmtier.commands`` entry points
by :mod:`.cli` (which imports nothing heavy, so building the ``lmtier`` parser stays
cheap):

* :mod:`.stats`: ``lmtier stats``, per-tier capacity, use, hit ratio, latency and
  failures, as a table or one JSON object of a stable schema (``--watch`` redraws);
* :mod:`.lookup`: ``lmtier lookup``, how many tokens of a prompt are cached, per tier;
* :mod:`.inspect_chunk`: ``lmtier inspect``, one chunk's header and checksum state;
* :mod:`.purge`: ``lmtier purge``, one model's KV deleted from every tier;
* :mod:`.model_args`: the model a command's flags name (``lookup``, ``purge``);
* :mod:`.caches`: opening the embedded tiers or a sidecar for these commands;
* :mod:`.render`: tables (``rich`` when installed) and human-readable sizes.

See ``docs/operations.md``.
"""
