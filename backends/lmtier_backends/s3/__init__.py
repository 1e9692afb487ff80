"""The S3 (and S3-compatible: MinIO) tier over boto3. Entry point ``s3``."""

from lmtier_backends.s3.tier import S3Tier, open_tier

__all__ = ["S3Tier", "open_tier"]
