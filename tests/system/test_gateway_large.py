"""No request stalls another in ``pcr gateway`` (issue 39): a 20 MB chat body beside a
normal request, a long prompt tokenized beside short ones, a 20 MB body of token ids
beside ``/health``, and prompts over the model's length refused before they are
tokenized, against a real gateway process, the repository's tiny tokenizer and a fake
engine.

The bounds are seconds where the code before the fix took many (a normal request beside
a 20 MB chat body: 12 to 17 s; ``/health`` beside a 20 MB body of token ids: about 1 s
to 3 s) and the fixed code takes milliseconds; the long-lane test waits for conditions
and asserts an order instead."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.fake_engine import FakeEngine
from tests.support.servers import RedisServer
from tests.support.serving import ServeProcess
from tests.support.tiny_tokenizer import words
from tests.support.waiting import wait_until

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

BIG_BYTES = 20_000_000
NORMAL_BOUND = 3.0
"""Seconds a normal request may take beside a 20 MB body (alone it takes milliseconds)."""
HEALTH_BOUND = 3.0
"""Seconds ``/health`` may take while a 20 MB body is handled (milliseconds alone; on the
event loop, the parse, check and hashing of ten million ids held it for seconds). Past a
busy machine's scheduling noise: beside two CPU burners one call took 1.2 s."""
LONGEST_TOKEN = 5
"""The tiny tokenizer's longest vocabulary entry in bytes (``<unk>``)."""


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    made = FakeEngine("a").start()
    try:
        yield made
    finally:
        made.stop()


def gateway(
    redis_server: RedisServer, engine: FakeEngine, tokenizer_dir: Path, *extra: str
) -> ServeProcess:
    return ServeProcess(
        "--redis-url",
        redis_server.url,
        "--key-prefix",
        f"gl{time.monotonic_ns()}",
        "--backend",
        f"ns-a={engine.url}",
        "--tokenizer",
        str(tokenizer_dir),
        "--scrape-interval",
        "0",
        *extra,
        path="/health",
        command="gateway",
    )


@pytest.fixture
def served(
    redis_server: RedisServer, engine: FakeEngine, tokenizer_dir: Path
) -> Iterator[ServeProcess]:
    proc = gateway(redis_server, engine, tokenizer_dir).start()
    try:
        yield proc
    finally:
        code = proc.stop()
        assert code == 0, proc.err
        assert "Traceback" not in proc.err, proc.err


NORMAL = {"model": "tiny", "messages": [{"role": "user", "content": words(list(range(20, 84)))}]}


def normal_time(client: httpx.Client) -> float:
    started = time.perf_counter()
    reply = client.post("/v1/chat/completions", json=NORMAL)
    took = time.perf_counter() - started
    assert reply.status_code == 200, reply.text
    return took


def chat_body(size: int) -> bytes:
    """A chat body of about ``size`` bytes: one user message of tiny-vocabulary words."""
    text = words([4 + i % 500 for i in range(size // 5)])
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": text}]}).encode()


class Sent:
    """A POST of ``content`` in a thread; ``uploaded`` is set once its last byte is
    handed to the socket, ``done`` with its reply."""

    def __init__(self, base: str, path: str, content: bytes) -> None:
        self.reply: httpx.Response | None = None
        self.error: BaseException | None = None
        self.uploaded = threading.Event()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._send, args=(base + path, content))
        self.thread.start()

    def _chunks(self, content: bytes) -> Iterator[bytes]:
        step = 1 << 20
        for start in range(0, len(content), step):
            yield content[start : start + step]
        self.uploaded.set()

    def _send(self, url: str, content: bytes) -> None:
        try:
            headers = {"content-type": "application/json", "content-length": str(len(content))}
            self.reply = httpx.post(
                url, content=self._chunks(content), headers=headers, timeout=300
            )
        except BaseException as exc:  # reported by result()
            self.error = exc
        finally:
            self.done.set()

    def result(self) -> httpx.Response:
        self.thread.join(300)
        assert self.error is None, self.error
        assert self.reply is not None
        return self.reply


def assert_openai_400(reply: httpx.Response, words_in_message: str) -> None:
    assert reply.status_code == 400, reply.text
    assert reply.headers["content-type"].startswith("application/json")
    body = reply.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == 400, body
    assert words_in_message in body["error"]["message"], body


def test_a_20_mb_chat_body_does_not_hold_up_a_normal_request(
    served: ServeProcess, engine: FakeEngine
) -> None:
    with httpx.Client(base_url=served.base, timeout=60) as client:
        for _ in range(3):
            normal_time(client)  # warm: connections, the lane's tokenizer copies
        alone = statistics.median(normal_time(client) for _ in range(5))
        big = Sent(served.base, "/v1/chat/completions", chat_body(BIG_BYTES))
        assert big.uploaded.wait(120)
        # Sent while the gateway parses and handles the big body (the code before the fix
        # tokenized it for seconds, under one lock).
        beside = [normal_time(client) for _ in range(3)]
        assert big.result().status_code == 200
    assert max(beside) < max(NORMAL_BOUND, 20 * alone), (alone, beside)
    assert [len(body["messages"][0]["content"]) > 1_000_000 for body in engine.received].count(
        True
    ) == 1


def test_a_long_prompt_is_tokenized_beside_short_ones_never_before_them(
    served: ServeProcess, engine: FakeEngine
) -> None:
    """A prompt that takes seconds to tokenize holds the long lane; short prompts, sent
    while it does, are tokenized and answered before it is done: there is no lock between
    them (with one, they would wait for it)."""
    long_text = chat_body(3_500_000)  # under MAX_PROMPT_CHARS: tokenized, for seconds
    big = Sent(served.base, "/v1/chat/completions", long_text)

    def tokenizing_long() -> bool:
        reply = httpx.get(f"{served.base}/health", timeout=30).json()
        assert not big.done.is_set(), "the long prompt was done before it was seen tokenizing"
        return bool(reply["tokenizing"]["long"] == 1)

    wait_until(tokenizing_long, 60, "the long prompt in the long lane")
    with httpx.Client(base_url=served.base, timeout=60) as client:
        for _ in range(3):
            normal_time(client)
        state = client.get("/health").json()
    assert state["tokenizing"]["long"] == 1, state  # still tokenizing the long one
    assert not big.done.is_set()
    assert len(engine.received) == 3  # the short ones only, so far
    assert big.result().status_code == 200
    assert httpx.get(f"{served.base}/health", timeout=30).json()["tokenizing"] == {
        "short": 0,
        "long": 0,
    }


def test_a_20_mb_body_of_token_ids_does_not_stall_health(
    served: ServeProcess, engine: FakeEngine
) -> None:
    """Its parsing (``json.loads`` holds the interpreter lock throughout), its token-id
    check and its hashing are done in the helper process, not on the event loop."""
    ids = [5] * (BIG_BYTES // 2)  # "5," : ten million ids, the most a 20 MB body holds
    content = json.dumps({"model": "tiny", "prompt": ids}, separators=(",", ":")).encode()
    took: list[float] = []
    with httpx.Client(base_url=served.base, timeout=60) as client:
        client.get("/health")
        big = Sent(served.base, "/v1/completions", content)
        while not big.done.is_set():
            started = time.perf_counter()
            assert client.get("/health").status_code == 200
            took.append(time.perf_counter() - started)
            time.sleep(0.01)
    assert big.result().status_code == 200
    assert len(took) >= 5, took
    assert max(took) < HEALTH_BOUND, sorted(took)[-5:]
    assert len(engine.received) == 1
    assert len(engine.received[0]["prompt"]) == len(ids)  # forwarded whole


def test_prompts_over_the_model_length_are_refused_before_they_are_tokenized(
    redis_server: RedisServer, engine: FakeEngine, tokenizer_dir: Path
) -> None:
    """``--max-model-len 1000``: a text over 1000 * 5 bytes (the vocabulary's longest
    entry) or more than 1000 token ids is 400 in the OpenAI shape and the engine never
    sees it; a prompt of exactly 1000 tokens (its 4,999 bytes just under the bound) and
    1000 token ids are sent on."""
    proc = gateway(redis_server, engine, tokenizer_dir, "--max-model-len", "1000").start()
    limit = 1000 * LONGEST_TOKEN
    try:
        base = proc.base
        over_chat = {"model": "tiny", "messages": [{"role": "user", "content": "w5 " * 2000}]}
        over_text = {"model": "tiny", "prompt": "w5" + " w5" * (limit // 3 + 1)}
        assert len(over_text["prompt"]) > limit
        over_ids = {"model": "tiny", "prompt": [5] * 1001}
        over_batch = {"model": "tiny", "prompt": [[5] * 10, [5] * 1001]}
        for path, body in [
            ("/v1/chat/completions", over_chat),
            ("/v1/completions", over_text),
            ("/v1/completions", over_ids),
            ("/v1/completions", over_batch),
        ]:
            reply = httpx.post(base + path, json=body, timeout=30)
            assert_openai_400(reply, "maximum context length is 1,000 tokens")
        huge = Sent(base, "/v1/chat/completions", chat_body(BIG_BYTES))
        assert_openai_400(huge.result(), "maximum context length")
        ids = json.dumps({"model": "tiny", "prompt": [5] * 2_000_000}).encode()
        assert_openai_400(Sent(base, "/v1/completions", ids).result(), "has 2,000,000")
        assert engine.received == []

        at_limit = " ".join(["w100"] * 999)  # 999 words and the BOS: 1000 tokens
        assert limit - 10 < len(at_limit) <= limit
        accepted = [
            ("/v1/completions", {"model": "tiny", "prompt": at_limit}),
            ("/v1/completions", {"model": "tiny", "prompt": [5] * 1000}),
        ]
        for path, body in accepted:
            assert httpx.post(base + path, json=body, timeout=30).status_code == 200
        assert len(engine.received) == 2
    finally:
        assert proc.stop() == 0, proc.err
    assert "Traceback" not in proc.err, proc.err


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "x", str((1 << 30) + 1)])
def test_a_bad_max_model_len_is_one_line_exit_2(value: str) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "pcr", "gateway", "--max-model-len", value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done
    assert "--max-model-len" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_model_length_comes_from_config_json_never_under_the_engines(tmp_path: Path) -> None:
    """The largest length key (vLLM takes the smallest) times a rope-scaling factor over 1,
    a multimodal model's ``text_config`` too; nothing usable: None."""
    from pcr.gateway.tokens import config_max_len

    def length(config: object) -> int | None:
        (tmp_path / "config.json").write_text(json.dumps(config))
        return config_max_len(tmp_path)

    assert config_max_len(tmp_path / "absent") is None
    assert length({"max_position_embeddings": 4096}) == 4096
    assert length({"max_position_embeddings": 4096, "seq_length": 8192}) == 8192
    scaled = {"max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    assert length(scaled) == 131072
    assert length({"text_config": {"max_position_embeddings": 2048}}) == 2048
    useless: list[object] = [{}, [], {"max_position_embeddings": "4096"}, {"n_positions": True}]
    for config in useless:
        assert length(config) is None
    (tmp_path / "config.json").write_text("{not json")
    assert config_max_len(tmp_path) is None


def test_a_large_body_is_parsed_apart_with_its_token_ids_left_there() -> None:
    """What the helper process answers: the body without its prompt of token ids, and
    their count, first block and block hashes; over the length, ``PromptTooLong``."""
    from pcr.gateway.tokens import PromptTooLong, _parse_apart
    from registry import block_hashes

    ids = list(range(4, 104))
    raw = json.dumps({"model": "tiny", "prompt": ids, "stream": True}).encode()
    body, found = _parse_apart(raw, False, 100, 4, True)
    assert body == {"model": "tiny", "stream": True}
    assert found is not None
    assert (found.count, found.root, found.hashes) == (100, (4, 5, 6, 7), block_hashes(ids, 4))
    with pytest.raises(PromptTooLong, match="maximum context length is 99 tokens"):
        _parse_apart(raw, False, 99, 4, True)
    text = json.dumps({"prompt": ["w5 w6", "w7"]}).encode()
    assert _parse_apart(text, False, None, 4, True) == ({"prompt": ["w5 w6", "w7"]}, None)
