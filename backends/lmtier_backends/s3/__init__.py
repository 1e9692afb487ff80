"""The S3 (and S3-compatible: MinIO) tier over boto3. Entry point ``s3``: :func:`open_tier`."""

from __future__ import annotations

from lmtier.config import S3TierConfig
from lmtier.errors import ConfigError
from lmtier_backends.s3.tier import S3Tier

__all__ = ["S3Tier", "open_tier"]


async def open_tier(config: S3TierConfig) -> S3Tier:
    """Entry point ``lmtier.backends: s3``: open the S3 tier ``config`` (the ``s3``
    section) describes."""
    if config.bucket is None:
        raise ConfigError("s3.bucket is not set: the S3 tier is disabled")
    settings = {name: getattr(config, name) for name in type(config).model_fields}
    return await S3Tier.open(**settings)
