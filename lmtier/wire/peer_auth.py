"""How the sidecars of a cluster prove to each other that they hold the node secret,
without ever sending it.

Why not a bearer token: the peer tier dials whatever address the directory in the
shared Redis names, and whoever can write that Redis can name a server of their own.
A bearer token would be handed to that server, which could then read every tenant's
chunks from the real nodes. So a peer call carries a *proof* instead, and the answer
carries one back:

* the caller sends ``x-lmtier-peer-proof: v1.<unix time>.<nonce>.<mac>``, where the
  MAC is HMAC-SHA256, under a key derived from the node secret, over the method, the
  **address the caller dialled** (the one the directory named), the time, a fresh
  nonce and the SHA-256 of the request's keys;
* the listener recomputes it with **its own advertised address**, checks the time
  (within ``peer.proof_window_s``) and that the nonce was not used before, and
  answers with ``x-lmtier-peer-answer``: a MAC over the caller's proof;
* the caller takes no byte of the reply before that answer checks out.

A planted server learns a MAC it cannot reuse: replayed to a real node it names the
planted address, not the node's, and covers only the keys the caller asked for. It
cannot answer the proof either, so the caller ignores it (and a forged chunk would
still fail the integrity MAC of ``integrity.key``). What the proof does not hide is
the traffic itself: without TLS (``peer.tls_*``) an eavesdropper on the network sees
the chunks a node fetches. The rejected alternative, TLS alone, leaves a cluster that
runs without it exactly as exposed as before; both are on in the shipped cluster.

The MAC's fields are length-prefixed, so no two different requests share an input.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmtier.config.peer import PeerConfig
from lmtier.config.secrets import Secret, read_secret_file
from lmtier.errors import AuthenticationError, ConfigError

__all__ = [
    "ANSWER_HEADER",
    "CONTAINS_METHOD",
    "FETCH_METHOD",
    "MAX_REMEMBERED",
    "PEER_SERVICE",
    "PROOF_HEADER",
    "NodeKey",
    "ProofChecker",
    "RequestProof",
    "node_key",
]

PEER_SERVICE = "lmtier.v1.Peer"
"""The peer listener's gRPC service; its methods' full names are what proofs cover."""
FETCH_METHOD = f"/{PEER_SERVICE}/Fetch"
CONTAINS_METHOD = f"/{PEER_SERVICE}/Contains"
PROOF_HEADER = "x-lmtier-peer-proof"
ANSWER_HEADER = "x-lmtier-peer-answer"
MAX_REMEMBERED = 262_144
"""Nonces a listener remembers (about 40 MB at most). Past that the oldest are
forgotten, and proofs no newer than the newest forgotten one are refused, so that no
nonce is ever accepted twice."""
_VERSION = "v1"
_NONCE_BYTES = 16
_DERIVE = b"lmtier peer node key v1"
_REQUEST = b"lmtier-peer-request-v1"
_ANSWER = b"lmtier-peer-answer-v1"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _fields(*parts: bytes) -> bytes:
    return b"".join(struct.pack(">I", len(part)) + part for part in parts)


class NodeKey:
    """The key both ends of a peer call derive from the node secret (module
    docstring); its repr shows nothing."""

    __slots__ = ("_key", "secret")

    def __init__(self, secret: Secret) -> None:
        self.secret = secret
        """Kept only for :meth:`Authenticator.accepts` (no sidecar token may equal it)."""
        raw = secret.reveal().encode("utf-8", "surrogatepass")
        self._key = hmac.new(raw, _DERIVE, hashlib.sha256).digest()

    def __repr__(self) -> str:
        return "NodeKey(***)"

    def mac(self, method: str, audience: str, stamp: int, nonce: bytes, keys: bytes) -> bytes:
        """The request MAC for ``keys`` sent with ``method`` to ``audience``."""
        message = _fields(
            _REQUEST,
            method.encode(),
            audience.encode(),
            str(stamp).encode(),
            nonce,
            hashlib.sha256(keys).digest(),
        )
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def answer(self, nonce: bytes, request_mac: bytes) -> str:
        """The listener's answer to a request whose proof had ``nonce`` and ``request_mac``."""
        message = _fields(_ANSWER, nonce, request_mac)
        return _b64(hmac.new(self._key, message, hashlib.sha256).digest())

    def prove(
        self, method: str, audience: str, keys: bytes, *, now: float | None = None
    ) -> RequestProof:
        """A fresh proof for one call of ``method`` to ``audience`` about ``keys``."""
        stamp = int(time.time() if now is None else now)
        nonce = secrets.token_bytes(_NONCE_BYTES)
        mac = self.mac(method, audience, stamp, nonce, keys)
        header = f"{_VERSION}.{stamp}.{_b64(nonce)}.{_b64(mac)}"
        return RequestProof(header, self.answer(nonce, mac))


def node_key(peer: PeerConfig) -> NodeKey:
    """The node key of ``peer`` (its ``token`` or ``token_file``); ConfigError when the
    section names neither, or the file cannot be read."""
    secret = peer.token
    if secret is None and peer.token_file is not None:
        secret = read_secret_file(peer.token_file, "peer.token_file")
    if secret is None or not secret.reveal():
        raise ConfigError(
            "the peer tier needs the cluster's node secret: set peer.token_file (or "
            "peer.token), the same on every node and unlike any sidecar token",
            key="peer.token",
        )
    return NodeKey(secret)


@dataclass(frozen=True, slots=True)
class RequestProof:
    """What a caller sends (``header``) and the answer it must get back."""

    header: str
    expected: str

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call's metadata."""
        return ((PROOF_HEADER, self.header),)

    def answered_by(self, metadata: Sequence[tuple[str, Any]] | None) -> bool:
        """Whether the reply's initial ``metadata`` carries the right answer."""
        values = [v for k, v in metadata or () if k.lower() == ANSWER_HEADER]
        if len(values) != 1:
            return False
        value = values[0]
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        return hmac.compare_digest(text.encode("latin-1", "replace"), self.expected.encode())


class ProofChecker:
    """The listener's side: checks a call's proof and makes its answer.

    ``audience`` is this node's advertised address (what the directory names it by);
    ``window_s`` how far a proof's time may be from this clock. Thread-safe.
    """

    def __init__(
        self,
        key: NodeKey,
        audience: str,
        *,
        window_s: float,
        remember: int = MAX_REMEMBERED,
        clock: Any = time.time,
    ) -> None:
        self.key, self.audience, self.window_s = key, audience, window_s
        self._remember, self._clock = remember, clock
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._floor = -1
        """Proofs stamped at or before this time are refused: nonces of that age
        may have been forgotten (:data:`MAX_REMEMBERED`)."""
        self._lock = threading.Lock()

    def check(
        self, metadata: Sequence[tuple[str, Any]] | None, method: str, keys: bytes
    ) -> tuple[tuple[str, str], ...]:
        """The answer metadata for a call whose ``metadata`` proves the node secret for
        ``method`` and ``keys``; AuthenticationError (one line, no secret) otherwise."""
        stamp, nonce, mac = _parse(metadata)
        now = self._clock()
        if abs(now - stamp) > self.window_s:
            raise AuthenticationError(
                f"the peer proof is stamped {now - stamp:+.0f} s from this node's clock "
                f"(at most {self.window_s:g} s: peer.proof_window_s): are the clocks set?"
            )
        expected = self.key.mac(method, self.audience, stamp, nonce, keys)
        if not hmac.compare_digest(expected, mac):
            raise AuthenticationError(
                "the peer proof does not match: another node secret, or made for another "
                f"address than {self.audience}"
            )
        self._admit(nonce, stamp)
        return ((ANSWER_HEADER, self.key.answer(nonce, mac)),)

    def _admit(self, nonce: bytes, stamp: int) -> None:
        with self._lock:
            horizon = self._clock() - self.window_s
            while self._seen:
                oldest, when = next(iter(self._seen.items()))
                if when >= horizon and len(self._seen) < self._remember:
                    break
                del self._seen[oldest]
                if when >= horizon:  # forgotten while it could still be replayed
                    self._floor = max(self._floor, when)
            if stamp <= self._floor:
                raise AuthenticationError("the peer proof is too old for this node to check")
            if nonce in self._seen:
                raise AuthenticationError("the peer proof was used before (a replay)")
            self._seen[nonce] = stamp


def _parse(metadata: Sequence[tuple[str, Any]] | None) -> tuple[int, bytes, bytes]:
    values = [v for k, v in metadata or () if k.lower() == PROOF_HEADER]
    if not values:
        if any(k.lower() == "authorization" for k, _ in metadata or ()):
            raise AuthenticationError(
                "peers authenticate with a proof of the node secret, never a bearer "
                "token: upgrade the calling node"
            )
        raise AuthenticationError(f"a peer call must carry '{PROOF_HEADER}' metadata")
    if len(values) > 1:
        raise AuthenticationError(f"the call carries more than one '{PROOF_HEADER}' entry")
    value = values[0]
    text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
    parts = text.split(".")
    try:
        if len(parts) != 4 or parts[0] != _VERSION or len(parts[1]) > 12:
            raise ValueError(text)
        stamp, nonce, mac = int(parts[1]), _unb64(parts[2]), _unb64(parts[3])
    except (ValueError, binascii.Error):
        raise AuthenticationError(f"the '{PROOF_HEADER}' metadata is malformed") from None
    if len(nonce) != _NONCE_BYTES or len(mac) != hashlib.sha256().digest_size:
        raise AuthenticationError(f"the '{PROOF_HEADER}' metadata is malformed")
    return stamp, nonce, mac
