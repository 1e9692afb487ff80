"""`lmtier warm` as a real process: every input kind into the embedded tiers and into a
sidecar, bad lines reported and the rest warmed, an interrupted run resumed without
recomputing, pins that hold under pressure within their cap, and the warmed KV serving
an engine with the logits of a full prefill."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import lmtier
from lmtier import LMTier, load_config
from lmtier_apps.demo.demo_model import build_demo_model
from lmtier_apps.demo.demo_tokenizer import demo_tokenizer
from lmtier_connector.hf.adapter import CachedCausalLM, kv_spec_of
from support.demo_server import CHUNK as SERVE_CHUNK
from support.demo_server import LONG_TEXT, Server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHUNK = 64
LIMIT_S = 900
"""Per warm process: a hang guard for a very loaded machine, never a speed check."""
SYSTEM = "You are a careful assistant who answers in one sentence. " * 8


def write_config(directory: Path, **extra: Any) -> Path:
    settings: dict[str, Any] = {
        "chunk_size": CHUNK,
        "cpu": {"capacity_bytes": "64MiB", "staging_bytes": "16MiB"},
        "disk": {"path": str(directory / "chunks"), "capacity_bytes": "1GiB"},
        **extra,
    }
    path = directory / "lmtier.yaml"
    path.write_text(json.dumps(settings))  # JSON is YAML
    return path


def warm(config: Path, *args: str, stdin: str | None = None, check: int | None = 0) -> Any:
    result = subprocess.run(
        [sys.executable, "-m", "lmtier.cli", "--config", str(config), "warm", "--json", *args],
        input=stdin,
        capture_output=True,
        text=True,
        check=False,
        timeout=LIMIT_S,
    )
    if check is not None:
        assert result.returncode == check, result.stderr[-4000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["schema"] == "lmtier.warm/1"
    return summary, result


def assert_served_exactly(hit: Any, plain: Any, cached: int, *, warmed: Any = None) -> None:
    """The KV a warm stored is the KV a full prefill of the warmed prompt computes, bit
    for bit (``warmed``: that prefill, when the warmed prompt is shorter than the whole
    one; else ``plain``). The logits then match a full prefill's of the whole prompt
    (``plain``) up to rounding (~1e-6 here, the same with the prefix KV kept in memory,
    no lmtier): torch's CPU attention blocks its sums by the sequence's length, so a
    prefix's KV computed inside a longer prompt can differ in its last bits on some
    CPUs (AVX-512 ones, at these lengths)."""
    assert hit.num_cached_tokens == cached
    reference = plain if warmed is None else warmed
    layers = zip(hit.past_key_values.layers, reference.past_key_values.layers, strict=True)
    for ours, theirs in layers:
        assert torch.equal(ours.keys[..., :cached, :], theirs.keys[..., :cached, :])
        assert torch.equal(ours.values[..., :cached, :], theirs.values[..., :cached, :])
    assert (hit.logits - plain.logits).abs().max() <= 1e-5


def demo_cache(config: Path) -> tuple[Any, LMTier]:
    demo = build_demo_model(0)
    cache = LMTier.open(
        load_config(config),
        kv=kv_spec_of(demo.model),
        model_id=demo.model_id,
        model_revision=demo.revision,
    )
    return demo, cache


def test_every_input_kind_is_warmed_and_serves_an_engine_exactly(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(
        "\n".join(
            json.dumps(item)
            for item in (
                {"prompt": SYSTEM + "What is a cache?"},
                {
                    "messages": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "Hi"},
                    ]
                },
                {"tokens": list(range(100, 400))},
            )
        )
        + "\n"
    )
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "a.txt").write_text("A document about tiers. " * 30)
    (docs / "sub" / "b.md").write_text("# Notes\n" + "Redis then S3. " * 40)
    summary, _ = warm(config, str(jsonl), str(docs), "-", stdin="Standard input text. " * 30)
    assert (summary["prompts"], summary["warmed"], summary["failed"]) == (6, 6, 0)
    assert summary["computed_tokens"] > 0 and summary["chunks_stored"].get("disk", 0) > 0

    again, _ = warm(config, str(jsonl), str(docs), "-", stdin="Standard input text. " * 30)
    assert (again["skipped"], again["warmed"], again["computed_tokens"]) == (6, 0, 0)

    tokenizer = demo_tokenizer()
    prompt = tokenizer(SYSTEM + "What is a cache?")["input_ids"]
    question = [*prompt, *tokenizer(" And a tier?", add_special_tokens=False)["input_ids"]]
    demo, cache = demo_cache(config)
    with cache:
        hit = CachedCausalLM(demo.model, cache).prefill(question, store=False)
        plain = CachedCausalLM(demo.model, None).prefill(question, store=False)
    warmed = CachedCausalLM(demo.model, None).prefill(prompt, store=False)
    assert_served_exactly(hit, plain, len(prompt) // CHUNK * CHUNK, warmed=warmed)
    assert hit.tokens_by_tier == {"disk": hit.num_cached_tokens}


def test_bad_lines_are_named_and_the_good_prompts_still_warmed(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    jsonl = tmp_path / "mixed.jsonl"
    lines = [
        json.dumps({"prompt": SYSTEM + "one"}),
        '{"prompt": "broken',
        json.dumps({"text": "no known field"}),
        json.dumps({"tokens": list(range(5, 20_000))}),  # beyond the demo's 16k context
        json.dumps({"tokens": list(range(7, 300))}),
        json.dumps({"tokens": [5, 6, 99_999]}),  # not in the demo's 32k vocabulary
    ]
    jsonl.write_text("\n".join(lines) + "\n")
    summary, result = warm(config, str(jsonl), check=1)
    assert (summary["prompts"], summary["warmed"], summary["failed"]) == (6, 2, 4)
    errors = [line for line in result.stderr.splitlines() if line.startswith("lmtier warm:")]
    assert len(errors) == 4
    assert f"{jsonl}:2: invalid JSON" in errors[0]
    assert f"{jsonl}:3:" in errors[1]
    assert f"{jsonl}:4:" in errors[2] and "context" in errors[2]
    assert f"{jsonl}:6:" in errors[3] and "vocab" in errors[3]
    assert all("Traceback" not in line for line in result.stderr.splitlines())


def _chunk_files(root: Path) -> int:
    return sum(1 for _ in (root / "chunks" / "v1").glob("*/*.lmtc"))


def test_an_interrupted_warm_resumes_without_recomputing(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    first = [json.dumps({"tokens": list(range(1000 * i, 1000 * i + 320))}) for i in range(1, 4)]
    later = [json.dumps({"tokens": list(range(1000 * i, 1000 * i + 320))}) for i in range(4, 6)]
    process = subprocess.Popen(
        [sys.executable, "-m", "lmtier.cli", "--config", str(config), "warm", "--json", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdin is not None
    process.stdin.write("\n".join(first) + "\n")
    process.stdin.flush()
    deadline = time.monotonic() + LIMIT_S
    # 3 prompts x 5 full chunks: wait until their files exist (the warm then waits on
    # stdin for more, or is about to), then interrupt it as Ctrl-C would. Wherever the
    # SIGINT lands (even where Python drops its KeyboardInterrupt: warm.interrupt),
    # the run ends interrupted; the files say what it stored, whatever it counted.
    while _chunk_files(tmp_path) < 15:
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the warm stored nothing"
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=LIMIT_S)
    assert process.returncode == 130, err[-3000:]
    interrupted = json.loads(out.strip().splitlines()[-1])
    assert interrupted["interrupted"] and interrupted["warmed"] in (2, 3)

    summary, _ = warm(config, "-", stdin="\n".join(first + later) + "\n")
    assert (summary["skipped"], summary["warmed"]) == (3, 2), "nothing stored is recomputed"
    assert summary["computed_tokens"] == 2 * 320
    assert _chunk_files(tmp_path) == 25


def test_pins_survive_pressure_and_are_capped(tmp_path: Path) -> None:
    # A disk tier of 24 chunks that may pin 6: warm 2 prompts of 5 chunks with --pin
    # (the second's last chunks pass the cap), then push 40 other chunks through it.
    chunk_bytes = kv_spec_of(build_demo_model(0).model).encoded_chunk_bytes(CHUNK) + 4096
    config = write_config(
        tmp_path,
        disk={
            "path": str(tmp_path / "chunks"),
            "capacity_bytes": 24 * chunk_bytes,
            "max_pinned_fraction": 0.25,
        },
    )
    pinned = [{"tokens": list(range(1000 * i, 1000 * i + 320))} for i in (1, 2)]
    source = tmp_path / "pinned.jsonl"
    source.write_text("\n".join(json.dumps(p) for p in pinned) + "\n")
    summary, _ = warm(config, "--pin", str(source))
    assert summary["pinned"]["disk"] == 6, "the cap: a quarter of 24 chunks"
    pressure = "\n".join(
        json.dumps({"tokens": list(range(10_000 + 400 * i, 10_000 + 400 * i + 320))})
        for i in range(8)
    )
    warm(config, "-", stdin=pressure + "\n")
    _, cache = demo_cache(config)
    with cache:
        first = cache.lookup(pinned[0]["tokens"])
        stats = cache.stats()["disk"]
    assert first.num_tokens == 5 * CHUNK, "the pinned prompt survived 40 other chunks"
    assert stats["pinned_chunks"] == 6 and stats["pins_refused"] >= 0
    assert stats["used_bytes"] <= stats["capacity_bytes"]


def test_warm_into_a_sidecar_serves_its_clients(tmp_path: Path) -> None:
    pytest.importorskip("grpc")
    from lmtier.testing.sidecar import SidecarProcess

    config = write_config(tmp_path)
    token = tmp_path / "token"
    token.write_text("warm-token\n")
    token.chmod(0o600)
    settings = {
        "chunk_size": CHUNK,
        "cpu": {"capacity_bytes": "128MiB"},
        "disk": {"enabled": False},
        "sidecar": {"auth_token": "warm-token"},
    }
    prompt = list(range(3000, 3000 + 4 * CHUNK + 5))
    with SidecarProcess(tmp_path / "sidecar", settings) as sidecar:
        args = ("--sidecar", sidecar.target, "--sidecar-token-file", str(token), "--pin")
        summary, _ = warm(config, *args, "-", stdin=json.dumps({"tokens": prompt}) + "\n")
        assert summary["warmed"] == 1 and summary["pinned"] == {"cpu": 4}
        demo = build_demo_model(0)
        with lmtier.connect(
            sidecar.target,
            load_config(config),
            kv=kv_spec_of(demo.model),
            model_id=demo.model_id,
            model_revision=demo.revision,
            token="warm-token",
        ) as client:
            hit = CachedCausalLM(demo.model, client).prefill(prompt, store=False)
            plain = CachedCausalLM(demo.model, None).prefill(prompt, store=False)
            assert_served_exactly(hit, plain, 4 * CHUNK)
            assert client.unpin_keys() == {"cpu": 4}
    assert os.path.exists(config)


def test_warm_then_via_an_engine_process_and_the_engine_reports_the_hits(tmp_path: Path) -> None:
    """`lmtier demo serve` over a disk directory that `warm --model` filled: its first
    request is served from disk (the engine tokenizes text as warm does); then `warm
    --via` makes the engine compute other prompts, which its next requests hit."""
    cache_dir = tmp_path / "cache"
    config = tmp_path / "serve.yaml"
    config.write_text(json.dumps({"chunk_size": SERVE_CHUNK}))
    text_a = "A: " + LONG_TEXT
    summary, _ = warm(config, "--cache-dir", str(cache_dir), "-", stdin=text_a)
    assert summary["warmed"] == 1
    full = len(demo_tokenizer()(text_a)["input_ids"]) // SERVE_CHUNK * SERVE_CHUNK
    engine = Server(tmp_path, cache_dir, "--device-blocks", "0")
    try:
        body = {"prompt": text_a, "max_tokens": 2, "temperature": 0}
        usage = engine.post("/v1/completions", body)["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == full
        assert usage["lmtier"]["cached_tokens_by_tier"] == {"disk": full}

        chat = [{"role": "system", "content": LONG_TEXT}, {"role": "user", "content": "Hi"}]
        prompts = tmp_path / "via.jsonl"
        prompts.write_text(
            json.dumps({"prompt": "B: " + LONG_TEXT}) + "\n" + json.dumps({"messages": chat}) + "\n"
        )
        summary, _ = warm(config, "--via", engine.url, "--concurrency", "2", str(prompts))
        assert (summary["warmed"], summary["failed"]) == (2, 0)
        assert summary["computed_tokens"] > 0
        again, _ = warm(config, "--via", engine.url, str(prompts))
        assert again["cached_tokens"] > 0 and again["computed_tokens"] < summary["computed_tokens"]
        reply = engine.post("/v1/chat/completions", {"messages": chat, "max_tokens": 1})
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= SERVE_CHUNK
        assert engine.stop() == 0
    finally:
        engine.kill()


def test_via_an_engine_that_is_not_there_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmtier.cli import main

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b'{"prompt": "x"}\n')))
    config = write_config(tmp_path)
    code = main(["--config", str(config), "warm", "--json", "--via", "http://127.0.0.1:9", "-"])
    out, err = capsys.readouterr()
    assert code == 1 and "127.0.0.1:9" in err and "Traceback" not in err
    assert json.loads(out.strip().splitlines()[-1])["warmed"] == 0
