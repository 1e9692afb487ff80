"""The S3 tier: one object per chunk, holding the chunk format's bytes unchanged.

Naming: ``<prefix><namespace hex>/<chain hex>`` (the two halves of the key, 32 hex
digits each), so one namespace (model revision, dtype, TP rank, tenant salt) is one
key prefix: list it, give it a lifecycle rule, or drop it with ``aws s3 rm
--recursive s3://<bucket>/<prefix><namespace hex>/``, which is what a purge does: it
lists the prefix a page of up to 1000 objects at a time (ListObjectsV2) and deletes
each page with one DeleteObjects.

Concurrency: boto3's sync client shared by a pool of ``max_concurrency`` threads,
with as many pooled connections; batches fan out over the pool. ``contains`` runs
``min(max_concurrency, len(keys))`` workers over a shared cursor that hands out keys
in order and stops at the first miss. The cursor starts like TCP: 2 HEADs in
flight, one more per hit (the window doubles each round trip) up to
``max_concurrency``. A batch of fresh keys costs 2 HEADs rather than a round of
``max_concurrency`` (S3 bills and rate-limits HEADs per prefix), a long hit reaches
full speed after a few round trips, and only HEADs in flight when the first miss is
answered go past it: fewer than ``4 * max_concurrency``, however slow that miss's
HEAD (the cursor runs at most four windows past the lowest key not answered).

No negative caching: every ``contains`` asks S3. A cached miss would hide chunks that
other nodes write (LMCache caches S3 misses for the process lifetime); a lookup of
fresh keys is cheap anyway because it stops at the first miss.

Client settings: botocore's CRC32 request checksums, response validation and SigV4
payload hash are off. The chunk format's xxh3 checksums are checked on every read
(``Tier.get_into``), end to end from writer's slab to reader's slab, and a second
and third hash per transfer only cost CPU. Standard retries with 2 attempts
(``total_max_attempts``; botocore's ``max_attempts`` counts only retries); connect and
read timeouts of ``timeout_s``.

Transfers (:mod:`lmtier_backends.s3.io`): a PUT body is :class:`ViewReader`, a
read/seek/tell file over the caller's buffer whose reads are memoryview slices, which
http.client passes to ``sendall``: no copy of the slab (botocore refuses a bare
memoryview; ``bytes(view)`` copies into fresh memory). A GET streams into the
caller's buffer through ``readinto`` of the http.client response under botocore's
urllib3 response (urllib3's own ``readinto`` reads into a temporary first);
elsewhere, ``read(1 MiB)`` slices are copied. benchmarks/bench_s3.py measures both
against a null endpoint: ~5-15% less client CPU per GiB each. An object larger than
its buffer (``ContentLength``, known before reading) is a miss.

Expiry: with ``ttl_s``, an object whose ``LastModified`` is older than ``ttl_s`` is a
miss on HEAD and GET and is deleted in the background (``stats.evictions``).
``LastModified`` has whole seconds and the server's clock: keep ``ttl_s`` far above a
few seconds. Objects nobody asks for again go by a bucket lifecycle rule of at least
``ttl_s`` in whole days (``aws s3api put-bucket-lifecycle-configuration --bucket B
--lifecycle-configuration file://rule.json``)::

    {"Rules": [{"ID": "lmtier-expire", "Status": "Enabled",
                "Filter": {"Prefix": "lmtier/"}, "Expiration": {"Days": 7}}]}

Failures: a 404 is a miss. Transport failures (refused or reset connections, DNS,
timeouts), missing credentials and 5xx answers (after the retry) are the tier's
failures; other client errors (403, 400) fail only their chunk. A batch in which no
request got an answer raises BackendTimeout (if a timeout was among the causes) or
BackendUnavailable, so the StorageManager's breaker sees outages; otherwise failed
items are misses or unstored chunks, counted in ``stats.errors``. At open, a missing
bucket or refused credentials are a ConfigError naming bucket and endpoint.

Deadlines: the StorageManager bounds each call by the tier's ``budget``: ``timeout_s``
plus the call's bytes at ``min_bytes_per_s`` plus ``lookup_key_s`` per key a lookup
asks about (512 HEADs took 2-3 s on moto with the CPU shared: a fixed 2 s turned a
full hit into 0 hits), and gives up on a call as soon as ``io_progress``, ticked by
every answer and every block sent or received, has stood still for ``timeout_s``
(:mod:`lmtier.storage.budget`), so a hung endpoint costs ``timeout_s``, not the deadline.

Credentials: from the config (:class:`~lmtier.config.secrets.Secret`, revealed only into the
client) or boto3's default chain. Logs and ``repr`` show the endpoint (redacted) and
bucket; opening installs a filter that masks the access key id and session token in
botocore's own DEBUG lines (it prints signed request headers).

Close returns at once even if the endpoint hangs, and so do the requests in flight:
it shuts down every connection of the client (:class:`~lmtier_backends.s3.io.Connections`),
so a thread blocked on a hung endpoint fails at once and its retry is refused; the pool
shuts down without waiting (``cancel_futures=True``). A closed tier keeps no thread
waiting out a timeout: calls in flight fail with BackendUnavailable (a cancelled one
returns, its buffers untouched, as soon as its thread has failed), and neither the
event loop nor interpreter exit (which joins the pool's threads) waits for the
endpoint. Only a TCP connect in progress is not interrupted: it ends within
``timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from botocore.exceptions import ClientError

from lmtier.chunks.keys import ChunkKey, split_key
from lmtier.config import S3TierConfig
from lmtier.config.secrets import redact_url
from lmtier.errors import BackendError, BackendUnavailable
from lmtier.storage.blocking import run_blocking
from lmtier.storage.budget import CallBudget, Progress
from lmtier.storage.failures import ExceptionMap, FailureLog, settle
from lmtier.storage.stats import TierStats
from lmtier.storage.tier import UNSERVABLE, Buffer, CheckedRead, Tier, TierProperties
from lmtier_backends.s3.io import (
    RULES,
    Connections,
    Scan,
    ViewReader,
    check_bucket,
    make_client,
    not_found,
    read_body_into,
    redact_botocore_logs,
)

__all__ = ["S3Tier", "read_body_into"]

logger = logging.getLogger(__name__)

_DELETE_BATCH = 1000
"""Keys per DeleteObjects request: the S3 limit."""
_EXPIRED = -2
"""Outcome of a GET of an object older than ``ttl_s`` (apart from UNSERVABLE, -1)."""
_UNASKED = object()
"""Outcome slot of a key ``contains`` never sent a HEAD for."""
T = TypeVar("T")


class S3Tier(Tier):
    """Chunks as objects in an S3 (or S3-compatible) bucket. See the module docstring.

    ``await S3Tier.open(bucket, endpoint_url=..., ...)`` (or
    :func:`~lmtier_backends.s3.open_tier` from a config); the constructor only stores its
    arguments, without I/O or threads.
    ``clock`` (unix time) decides expiry; tests move it instead of sleeping.
    """

    def __init__(
        self,
        bucket: str,
        *,
        name: str = "s3",
        clock: Callable[[], float] = time.time,
        **settings: Any,
    ) -> None:
        """``settings`` are the other fields of :class:`~lmtier.config.S3TierConfig`
        (``endpoint_url``, ``prefix``, ``ttl_s``, ...), checked as the config checks them."""
        config = S3TierConfig(bucket=bucket, **settings)
        assert config.bucket is not None  # checked non-empty by S3TierConfig
        self.name = name
        self.properties = TierProperties(
            shared=True,
            write_policy=config.write_policy,
            queue_depth=config.queue_depth,
            timeout_s=config.timeout_s,
        )
        self.stats = TierStats()
        self.budget = CallBudget(
            config.timeout_s, config.min_bytes_per_s or None, config.lookup_key_s
        )
        """The deadline of each call, read by the StorageManager's guard."""
        self.io_progress = Progress()
        """Ticked by every answer and every block sent or received: a hung endpoint
        stops it."""
        self._failures = FailureLog(name, self.stats)
        self.config = config
        self.bucket: str = config.bucket
        self.prefix = config.prefix
        self._exceptions = ExceptionMap(
            f"S3 tier {name!r} ({self.bucket} at {self._where()})", RULES
        )
        self._clock = clock
        self._client: Any = None
        self._connections = Connections(f"S3 tier {name!r} ({self.bucket}) is closed")
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._background: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        where = f"bucket={self.bucket!r}, prefix={self.prefix!r}, endpoint={self._where()!r}"
        return f"S3Tier(name={self.name!r}, {where})"

    def _where(self) -> str:
        url = self.config.endpoint_url
        return redact_url(url) if url else "the AWS endpoint"

    @property
    def client(self) -> Any:
        """The boto3 S3 client (None until open): for tools that set lifecycle rules or
        list a namespace, and for tests."""
        return self._client

    async def start(self) -> None:
        """Build the client and check the bucket (HeadBucket): ConfigError if the bucket
        does not exist or the credentials are refused; BackendUnavailable if the endpoint
        cannot be reached."""
        redact_botocore_logs()
        workers = self.config.max_concurrency
        pool = ThreadPoolExecutor(workers, thread_name_prefix=f"lmtier-{self.name}")
        loop = asyncio.get_running_loop()
        # Each client its own: a start() tried again after a failed one finds none aborted.
        self._connections = Connections(self._connections.closed_message)
        try:
            self._client = await loop.run_in_executor(pool, make_client, self.config)
            self._connections.attach(self._client)  # before the client's first request
            await loop.run_in_executor(pool, check_bucket, self._client, self.bucket, self._where())
        except BaseException:
            self._connections.abort()
            pool.shutdown(wait=False, cancel_futures=True)
            if self._client is not None:
                self._client.close()
            raise
        self._pool = pool
        msg = "%s: bucket %s at %s, prefix %r, ttl %s s, %d connections"
        logger.info(
            msg, self.name, self.bucket, self._where(), self.prefix, self.config.ttl_s, workers
        )

    def namespace_prefix(self, namespace: bytes) -> str:
        """The key prefix of every object of one namespace (its 16-byte digest)."""
        return f"{self.prefix}{namespace.hex()}/"

    def object_key(self, key: ChunkKey) -> str:
        """The object key that holds (or would hold) chunk ``key``."""
        namespace, chain = split_key(key)
        return f"{self.prefix}{namespace.hex()}/{chain.hex()}"

    def _expired(self, last_modified: Any) -> bool:
        ttl = self.config.ttl_s
        return ttl is not None and self._clock() - last_modified.timestamp() > ttl

    # ---- requests (run in the pool's threads) ----------------------------------------

    def _ask(self, request: Callable[..., Any], key: ChunkKey) -> Any:
        """``request`` (HEAD or GET) for ``key``'s object: its response, or None for a 404.
        Either answer ticks the progress meter; other errors raise."""
        try:
            response = request(Bucket=self.bucket, Key=self.object_key(key))
        except ClientError as exc:
            if not not_found(exc):
                raise
            response = None
        self.io_progress.tick()
        return response

    def _head(self, key: ChunkKey) -> bool | None:
        """True: present; False: present but expired; None: absent."""
        response = self._ask(self._client.head_object, key)
        return None if response is None else not self._expired(response["LastModified"])

    def _scan(self, scan: Scan) -> None:
        """HEAD keys from the shared cursor until it has none left."""
        while (index := scan.take()) is not None:
            try:
                outcome: object = self._head(scan.keys[index])
            except Exception as exc:  # sorted by settle() on the loop, with the others
                outcome = exc
            scan.outcomes[index] = outcome
            scan.finish(index, outcome is True)

    def _get_into(self, key: ChunkKey, view: memoryview) -> int | None:
        response = self._ask(self._client.get_object, key)
        if response is None:
            return None
        body = response["Body"]
        size = int(response["ContentLength"])
        if size > len(view) or self._expired(response["LastModified"]):
            body.close()  # unread bytes: the connection is dropped, not reused
            return UNSERVABLE if size > len(view) else _EXPIRED
        try:
            read_body_into(body, view[:size], meter=self.io_progress)
        except BaseException:
            body.close()
            raise
        return size

    def _get_checked(self, key: ChunkKey, view: memoryview) -> int | CheckedRead | None:
        """:meth:`_get_into`, then the chunk checked here (:meth:`Tier.check_read`)."""
        size = self._get_into(key, view)
        return size if size is None or size < 0 else self.check_read(key, view, size)

    def _put_one(self, key: ChunkKey, view: memoryview) -> int:
        body = ViewReader(view, self.io_progress)
        self._client.put_object(
            Bucket=self.bucket, Key=self.object_key(key), Body=body, ContentLength=len(view)
        )
        self.io_progress.tick()
        return len(view)

    def _delete_objects(self, names: Sequence[str]) -> int:
        """One DeleteObjects of up to ``_DELETE_BATCH`` object keys; how many went (those
        S3 did not refuse: absent ones count, as S3 does not say)."""
        objects = [{"Key": name} for name in names]
        response = self._client.delete_objects(
            Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True}
        )
        self.io_progress.tick()
        errors = response.get("Errors", [])
        for error in errors:
            self._failures.record("delete", error, "refused")
        return len(names) - len(errors)

    def _list_page(self, prefix: str, token: str | None) -> tuple[list[str], str | None]:
        """One ListObjectsV2 page of up to ``_DELETE_BATCH`` object keys under ``prefix``,
        and the token of the next page (None after the last)."""
        more = {"ContinuationToken": token} if token else {}
        response = self._client.list_objects_v2(
            Bucket=self.bucket, Prefix=prefix, MaxKeys=_DELETE_BATCH, **more
        )
        self.io_progress.tick()
        names = [item["Key"] for item in response.get("Contents", ())]
        return names, response.get("NextContinuationToken") if response["IsTruncated"] else None

    # ---- the Tier interface ---------------------------------------------------------

    async def contains(self, keys: Sequence[ChunkKey]) -> int:
        pool = self._require_pool()
        self.stats.lookups += len(keys)
        workers = min(self.config.max_concurrency, len(keys))
        scan = Scan(keys, len(keys), min(2, workers), workers, [_UNASKED] * len(keys))
        loop = asyncio.get_running_loop()
        try:
            await asyncio.gather(
                *(loop.run_in_executor(pool, self._scan, scan) for _ in range(workers))
            )
        finally:
            scan.cancel()  # if we were cancelled: the workers take no further key
        asked = [(k, o) for k, o in zip(keys, scan.outcomes, strict=True) if o is not _UNASKED]
        settle(self._failures, self._exceptions, "head", [o for _, o in asked])
        self._expire([k for k, o in asked if o is False])
        return scan.stop

    async def _read_checked(
        self, keys: Sequence[ChunkKey], buffers: Sequence[memoryview]
    ) -> list[int | CheckedRead | None]:
        """GETs in the pool; each chunk decoded and checked by the thread that read it,
        so a batch's checksums overlap its other GETs instead of following them all on
        the event loop's thread (~10% of a load from moto)."""
        views = [buffer.cast("B") for buffer in buffers]
        outcomes = await self._map(self._get_checked, list(zip(keys, views, strict=True)))
        settle(self._failures, self._exceptions, "get", outcomes)
        self._expire([k for k, o in zip(keys, outcomes, strict=True) if o == _EXPIRED])
        return [
            o if isinstance(o, CheckedRead) or (isinstance(o, int) and o != _EXPIRED) else None
            for o in outcomes
        ]

    async def _read_into(
        self, keys: Sequence[ChunkKey], buffers: Sequence[memoryview]
    ) -> list[int | None]:
        checked = await self._read_checked(keys, buffers)
        return [o.size if isinstance(o, CheckedRead) else o for o in checked]

    async def put(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> int:
        views = [(key, memoryview(data).cast("B")) for key, data in items]
        outcomes = await self._map(self._put_one, views)
        settle(self._failures, self._exceptions, "put", outcomes)
        stored = [o for o in outcomes if isinstance(o, int)]
        self.stats.puts += len(stored)
        self.stats.bytes_written += sum(stored)
        return len(stored)

    async def delete(self, keys: Sequence[ChunkKey]) -> int:
        """HEAD every key (DeleteObjects does not say what existed), delete those present;
        returns how many were present and unexpired."""
        unique = list(dict.fromkeys(keys))
        outcomes = await self._map(self._head, [(key,) for key in unique])
        settle(self._failures, self._exceptions, "head", outcomes)
        await self._delete(
            [k for k, o in zip(unique, outcomes, strict=True) if isinstance(o, bool)]
        )
        return sum(o is True for o in outcomes)

    async def _delete(self, keys: Sequence[ChunkKey]) -> None:
        names = [self.object_key(key) for key in keys]
        batches = [(names[i : i + _DELETE_BATCH],) for i in range(0, len(names), _DELETE_BATCH)]
        outcomes = await self._map(self._delete_objects, batches)
        settle(self._failures, self._exceptions, "delete", outcomes)

    async def _purge(self, namespace: bytes) -> int:
        return await self._walk_namespace(namespace, delete=True)

    async def _count_namespace(self, namespace: bytes) -> int:
        return await self._walk_namespace(namespace, delete=False)

    async def _walk_namespace(self, namespace: bytes, *, delete: bool) -> int:
        # Page by page, list then delete: each page one thread hop, so a cancelled purge
        # stops between requests. The listing resumes after the last key it returned,
        # so deleting behind it skips nothing.
        prefix, token, found = self.namespace_prefix(namespace), None, 0
        while True:
            names, token = await self._purge_step(self._list_page, prefix, token)
            if names and delete:
                found += await self._purge_step(self._delete_objects, names)
            else:
                found += len(names)
            if token is None:
                return found

    async def _purge_step(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the pool; any failure fails the purge (as lmtier's error)."""
        (outcome,) = await self._map(fn, [args])
        if isinstance(outcome, BaseException):
            raise self._exceptions.error(outcome, "purge") from outcome
        return cast(T, outcome)

    async def _map(self, fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Run ``fn`` on each argument tuple in the pool; outcomes in order. If cancelled,
        returns only once no request of the batch touches its buffers (the tier contract)."""
        return await run_blocking(self._require_pool(), [(fn, a) for a in calls])

    def _expire(self, keys: list[ChunkKey]) -> None:
        """Delete expired objects in the background: the caller does not wait for it.

        Another node may rewrite a key between our HEAD and this delete; its fresh
        object then goes too, which costs one miss, never wrong bytes.
        """
        if not keys or self._closed:
            return
        self.stats.evictions += len(keys)
        task = asyncio.get_running_loop().create_task(self._delete_quietly(keys))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _delete_quietly(self, keys: list[ChunkKey]) -> None:
        try:
            await self._delete(keys)
        except BackendError as exc:
            self._failures.record("expire", exc)

    async def close(self) -> None:
        """Shut down the client's connections, which ends requests in flight (they fail
        with BackendUnavailable), and stop the pool without waiting: returns at once even
        if the endpoint hangs. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in list(self._background):
            task.cancel()
        self._connections.abort()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if self._client is not None:
            self._client.close()

    def _require_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            state = "closed" if self._closed else "not open (use S3Tier.open)"
            raise BackendUnavailable(f"S3 tier {self.name!r} ({self.bucket}) is {state}")
        return self._pool
