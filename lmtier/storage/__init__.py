"""Storing chunks: the tier interface, the tiers held in this process (host memory),
and the StorageManager that walks them.

* :mod:`~lmtier.storage.tier`: the async, batch-first tier interface and its contract.
* :mod:`~lmtier.storage.manager`: waterfall lookup, loads, promotion, write-down.
* :mod:`~lmtier.storage.guard`, :mod:`~lmtier.storage.budget`,
  :mod:`~lmtier.storage.breaker`, :mod:`~lmtier.storage.pacing`,
  :mod:`~lmtier.storage.blocking`: how a call to a tier is made safe (deadlines that
  grow with the work a call carries, a hang told from a slow call by the tier's I/O
  progress, a circuit breaker, batches sized to the tier's speed, slabs held while I/O
  may touch them).
* :mod:`~lmtier.storage.check`: what a served chunk must be.
* :mod:`~lmtier.storage.purging`: purging a namespace, and keeping it purged.
* :mod:`~lmtier.storage.host_pool`, :mod:`~lmtier.storage.cpu_tier`: the host pool and the
  CPU tier over it.
* :mod:`~lmtier.storage.plugins`, :mod:`~lmtier.storage.reopening_tier`: opening the
  backends found by entry point, and standing in for one that is down.
* :mod:`~lmtier.storage.lookup`, :mod:`~lmtier.storage.stats`: results and counters.
"""
