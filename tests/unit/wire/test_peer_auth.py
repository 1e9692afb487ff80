"""The peer proof (lmtier.wire.peer_auth): what a listener accepts, what it refuses,
and that no proof ever carries or reveals the node secret."""

from __future__ import annotations

import pytest

from lmtier.config import LMTierConfig
from lmtier.config.secrets import Secret
from lmtier.errors import AuthenticationError, ConfigError
from lmtier.wire.peer_auth import ANSWER_HEADER, PROOF_HEADER, NodeKey, ProofChecker, node_key

SECRET = "node-secret-0123456789abcdef"
METHOD = "/lmtier.v1.Peer/Fetch"
HERE = "10.0.0.5:7070"
KEYS = bytes(range(32)) * 3


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def checker(clock: Clock, *, remember: int = 1000, secret: str = SECRET) -> ProofChecker:
    return ProofChecker(
        NodeKey(Secret(secret)), HERE, window_s=60.0, remember=remember, clock=clock
    )


def test_a_proof_for_this_address_is_answered_and_the_answer_checks() -> None:
    clock = Clock()
    proof = NodeKey(Secret(SECRET)).prove(METHOD, HERE, KEYS, now=clock.now)
    answer = checker(clock).check(proof.metadata, METHOD, KEYS)
    assert proof.answered_by(answer)
    assert SECRET not in proof.header and SECRET not in answer[0][1]
    assert not proof.answered_by(())
    assert not proof.answered_by(((ANSWER_HEADER, "x" * 43),))
    other = NodeKey(Secret(SECRET)).prove(METHOD, HERE, KEYS, now=clock.now)
    assert not other.answered_by(answer)  # an answer is for one proof only


@pytest.mark.parametrize(
    ("audience", "method", "keys", "secret"),
    [
        ("10.6.6.6:7070", METHOD, KEYS, SECRET),  # made for a planted address
        (HERE, "/lmtier.v1.Peer/Contains", KEYS, SECRET),  # another method
        (HERE, METHOD, KEYS[:32], SECRET),  # other keys
        (HERE, METHOD, KEYS, "another-secret-0123456789abc"),  # another cluster
    ],
)
def test_a_proof_made_for_anything_else_is_refused(
    audience: str, method: str, keys: bytes, secret: str
) -> None:
    clock = Clock()
    proof = NodeKey(Secret(secret)).prove(method, audience, keys, now=clock.now)
    with pytest.raises(AuthenticationError, match="does not match"):
        checker(clock).check(proof.metadata, METHOD, KEYS)


def test_a_proof_is_accepted_once() -> None:
    clock = Clock()
    listener = checker(clock)
    proof = NodeKey(Secret(SECRET)).prove(METHOD, HERE, KEYS, now=clock.now)
    listener.check(proof.metadata, METHOD, KEYS)
    with pytest.raises(AuthenticationError, match="replay"):
        listener.check(proof.metadata, METHOD, KEYS)


def test_a_stale_or_future_proof_is_refused() -> None:
    clock = Clock()
    key = NodeKey(Secret(SECRET))
    for offset in (-61.0, 61.0):
        proof = key.prove(METHOD, HERE, KEYS, now=clock.now + offset)
        with pytest.raises(AuthenticationError, match=r"peer.proof_window_s"):
            checker(clock).check(proof.metadata, METHOD, KEYS)
    fresh = key.prove(METHOD, HERE, KEYS, now=clock.now - 59.0)
    checker(clock).check(fresh.metadata, METHOD, KEYS)


def test_forgotten_nonces_never_let_a_replay_through() -> None:
    """With more calls inside the window than it remembers, the listener refuses proofs
    as old as the ones it forgot, so that none is accepted twice."""
    clock, key = Clock(), NodeKey(Secret(SECRET))
    listener = checker(clock, remember=4)
    proofs = []
    for _ in range(6):
        clock.now += 1
        proof = key.prove(METHOD, HERE, KEYS, now=clock.now)
        listener.check(proof.metadata, METHOD, KEYS)
        proofs.append(proof)
    for proof in proofs:
        with pytest.raises(AuthenticationError, match=r"replay|too old"):
            listener.check(proof.metadata, METHOD, KEYS)
    clock.now += 1
    listener.check(key.prove(METHOD, HERE, KEYS, now=clock.now).metadata, METHOD, KEYS)


@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        ((), "must carry"),
        ((("authorization", f"Bearer {SECRET}"),), "never a bearer token"),
        (((PROOF_HEADER, "v1.1.2.3"), (PROOF_HEADER, "v1.1.2.3")), "more than one"),
        (((PROOF_HEADER, "v2.1800000000.AAAA.AAAA"),), "malformed"),
        (((PROOF_HEADER, "v1.soon.AAAAAAAAAAAAAAAAAAAAAA.AAAA"),), "malformed"),
        (((PROOF_HEADER, "v1.1800000000.!!.AAAA"),), "malformed"),
        (((PROOF_HEADER, "v1.1800000000.AAAA.AAAA"),), "malformed"),  # short nonce
        (((PROOF_HEADER, b"\xff\xfe"),), "malformed"),
        (((PROOF_HEADER, "v1." + "9" * 400 + ".A.A"),), "malformed"),
    ],
)
def test_malformed_proofs_are_one_line_refusals(
    metadata: tuple[tuple[str, object], ...], match: str
) -> None:
    with pytest.raises(AuthenticationError, match=match) as refused:
        checker(Clock()).check(metadata, METHOD, KEYS)
    assert "\n" not in str(refused.value) and SECRET not in str(refused.value)


def test_the_node_key_comes_from_the_peer_section_and_never_shows() -> None:
    with pytest.raises(ConfigError, match="node secret"):
        node_key(LMTierConfig(peer={"enabled": True}).peer)
    key = node_key(LMTierConfig(peer={"enabled": True, "token": SECRET}).peer)
    assert SECRET not in repr(key)
