"""`lmtier warm --prefetch` between two nodes sharing a real redis-server: node A
computes a prompt's KV (its disk and Redis get it), node B pulls the chunks from Redis
into its own disk tier, and keeps serving them after Redis is flushed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lmtier import LMTier, load_config
from lmtier_apps.demo.demo_model import build_demo_model
from lmtier_connector.hf.adapter import kv_spec_of
from support.redis_servers import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHUNK = 64
PROMPT = {"tokens": list(range(2000, 2000 + 5 * CHUNK + 7))}


def flush(redis_server: RedisServer) -> None:
    with redis_server.client() as client:  # closed: no socket left for the collector
        client.flushall()


def node(directory: Path, redis_url: str | None) -> Path:
    settings: dict[str, Any] = {
        "chunk_size": CHUNK,
        "cpu": {"capacity_bytes": "32MiB", "staging_bytes": "16MiB"},
        "disk": {"path": str(directory / "chunks"), "capacity_bytes": "256MiB"},
    }
    if redis_url is not None:
        settings["redis"] = {"url": redis_url}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "lmtier.yaml"
    path.write_text(json.dumps(settings))
    return path


def warm(config: Path, *args: str, stdin: str | None = None) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "lmtier.cli", "--config", str(config), "warm", "--json", *args, "-"],
        input=stdin if stdin is not None else json.dumps(PROMPT) + "\n",
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    summary: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return summary


def test_prefetch_pulls_a_peers_chunks_from_redis_onto_local_disk(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    flush(redis_server)
    computed = warm(node(tmp_path / "a", redis_server.url))
    assert computed["warmed"] == 1 and computed["chunks_stored"]["redis"] == 5

    b = node(tmp_path / "b", redis_server.url)
    fetched = warm(b, "--prefetch")
    assert (fetched["warmed"], fetched["chunks_stored"]) == (1, {"redis": 5})
    assert warm(b, "--prefetch")["skipped"] == 1, "now on B's disk: nothing to fetch"

    flush(redis_server)
    demo = build_demo_model(0)
    local_only = node(tmp_path / "b", None)
    with LMTier.open(
        load_config(local_only),
        kv=kv_spec_of(demo.model),
        model_id=demo.model_id,
        model_revision=demo.revision,
    ) as cache:
        found = cache.lookup(PROMPT["tokens"])
        assert found.tokens_by_tier(CHUNK) == {"disk": 5 * CHUNK}
        with cache.load(PROMPT["tokens"]) as hit:
            assert hit.num_tokens == 5 * CHUNK  # checksums verified on the way


def model_dir_without_weights(directory: Path) -> Path:
    """A model directory as far as keys go: config.json and a tokenizer, no weights."""
    from lmtier_apps.demo.demo_tokenizer import demo_tokenizer

    directory.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 128,
        "vocab_size": 259,
        "max_position_embeddings": 4096,
        "dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config))
    demo_tokenizer().save_pretrained(directory)
    return directory


def test_prefetch_with_a_model_directory_reads_no_weights(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    from lmtier.model_dir import model_identity
    from lmtier.ops.model_args import model_settings

    flush(redis_server)
    model = model_dir_without_weights(tmp_path / "model")
    config = node(tmp_path / "node", redis_server.url)
    text = "A shared system prompt. " * 20
    args = ("--prefetch", "--model", str(model))
    result = subprocess.run(
        [sys.executable, "-m", "lmtier.cli", "--config", str(config), "warm", "--json", *args, "-"],
        input=text,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 1, result.stderr[-3000:]  # ran without weights; nothing there
    assert "nothing to prefetch" in result.stderr and "Traceback" not in result.stderr

    # The same namespace stored into Redis by another process: now prefetch finds it.
    model_id, revision = model_identity(model)
    fields, vocab = model_settings(model)
    from lmtier import KVSpec
    from lmtier_apps.demo.demo_tokenizer import demo_tokenizer

    ids = demo_tokenizer()(text)["input_ids"]
    spec = KVSpec(**fields)
    remote_only = load_config(config).replace(disk=load_config(config).disk.replace(enabled=False))
    with LMTier.open(
        remote_only, kv=spec, model_id=model_id, model_revision=revision, vocab_size=vocab
    ) as cache:
        stored = cache.store(ids, torch.randn(spec.shape(len(ids))))
        cache.flush()
    assert stored == len(ids) // CHUNK
    summary = warm(config, *args, stdin=text)
    assert summary["warmed"] == 1 and summary["chunks_stored"] == {"redis": stored}
