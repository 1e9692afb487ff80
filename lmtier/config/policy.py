"""How a tier receives new chunks and how many may wait for it: the names the
configuration and the storage layer share.

They live here, in config, because config sits below storage (storage imports them
from here; config imports nothing from storage).
"""

from __future__ import annotations

from typing import Literal, TypeAlias

__all__ = ["DEFAULT_QUEUE_DEPTH", "ConfiguredWritePolicy", "WritePolicy"]

ConfiguredWritePolicy: TypeAlias = Literal["write_through", "write_back"]
"""What a tier's config section may say: ``write_through`` receives every new chunk in
the background; ``write_back`` only the chunks the CPU tier evicts."""

WritePolicy: TypeAlias = ConfiguredWritePolicy | Literal["none"]
"""What a tier declares (``TierProperties.write_policy``): a configured policy, or
``none`` for a tier that is only read (the peer tier, whose chunks are other nodes'
memory; no section can ask for it)."""

DEFAULT_QUEUE_DEPTH = 4096
"""Background writes a tier may have waiting (at most half the host pool's slabs: see
:mod:`lmtier.storage.writes`): a burst of several 128k-token prompts, not 256 chunks."""
