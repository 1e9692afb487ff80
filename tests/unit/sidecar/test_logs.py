"""JSON log lines, plain text lines, and the redaction of bearer tokens in both."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator

import pytest

from lmtier.errors import ConfigError
from lmtier.sidecar.logs import JsonFormatter, TextFormatter, redact, setup_logging

TOKEN = "tok-8c1f0e2a"


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    """The root logger, restored after the test (setup_logging changes it)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


def log_line(formatter: logging.Formatter, **kwargs: object) -> str:
    """What ``formatter`` makes of one record logged by ``lmtier.test``."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    logger = logging.getLogger("lmtier.test")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    try:
        level = kwargs.pop("level", logging.INFO)
        msg, args = kwargs.pop("msg"), kwargs.pop("args", ())
        assert isinstance(level, int) and isinstance(args, tuple)
        logger.log(level, msg, *args, **kwargs)  # type: ignore[arg-type]
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
        logger.setLevel(logging.NOTSET)
    return stream.getvalue()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"Bearer {TOKEN}", "Bearer **********"),
        (f"authorization: bearer {TOKEN}, next", "authorization: bearer **********, next"),
        (f"('authorization', 'BEARER {TOKEN}')", "('authorization', 'BEARER **********')"),
        (f"header=Bearer%20{TOKEN}&x=1", "header=Bearer%20**********"),
        (f"on b'Bearer\\t{TOKEN}\\xe9'", "on b'Bearer\\t**********\\xe9'"),  # a bytes repr
        ("a bearer of news", "a bearer ********** news"),
        ("no secrets here", "no secrets here"),
        ("Bearer", "Bearer"),
    ],
)
def test_redact(text: str, expected: str) -> None:
    assert redact(text) == expected
    assert TOKEN not in redact(text)


def test_json_line_fields() -> None:
    line = log_line(JsonFormatter(), msg="opened %d sessions for %s", args=(3, "vllm"))
    assert line.endswith("\n") and line.count("\n") == 1
    record = json.loads(line)
    assert record["level"] == "INFO"
    assert record["logger"] == "lmtier.test"
    assert record["msg"] == "opened 3 sessions for vllm"
    assert set(record) == {"ts", "level", "logger", "msg"}


def test_timestamp_is_utc_iso8601_with_milliseconds() -> None:
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, "m", None, None)
    record.created = 86400 + 3661.1239
    assert json.loads(JsonFormatter().format(record))["ts"] == "1970-01-02T01:01:01.123Z"


def test_extra_fields_that_json_can_hold() -> None:
    extra = {
        "session": 12,
        "tiers": ["cpu", "disk"],
        "peer": {"pid": 7, "auth": f"Bearer {TOKEN}"},
        "client": object(),
        "ratio": float("nan"),
        "level": "spoofed",
    }
    record = json.loads(log_line(JsonFormatter(), msg="hi", extra=extra))
    assert record["session"] == 12
    assert record["tiers"] == ["cpu", "disk"]
    assert record["peer"] == {"pid": 7, "auth": "Bearer **********"}
    assert "client" not in record and "ratio" not in record
    assert record["level"] == "INFO"  # the formatter's own fields win


def test_exceptions_go_under_exc_redacted() -> None:
    try:
        raise ValueError(f"bad header Bearer {TOKEN}")
    except ValueError:
        line = log_line(JsonFormatter(), msg="call failed", level=logging.ERROR, exc_info=True)
    record = json.loads(line)
    assert (
        "Traceback" in record["exc"] and "ValueError: bad header Bearer **********" in record["exc"]
    )
    assert TOKEN not in line


def test_messages_and_arguments_are_redacted() -> None:
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    line = log_line(JsonFormatter(), msg="metadata %s", args=(metadata,))
    assert TOKEN not in line
    assert "Bearer **********" in json.loads(line)["msg"]
    text = log_line(TextFormatter(), msg="metadata %s", args=(metadata,))
    assert TOKEN not in text and "lmtier.test: metadata" in text


def test_arguments_that_do_not_fit_still_make_a_line() -> None:
    record = json.loads(log_line(JsonFormatter(), msg="%d items", args=("many",)))
    assert record["msg"].startswith("%d items (unformattable arguments: ")


def test_setup_logging_json(root_logger: logging.Logger) -> None:
    stream = io.StringIO()
    setup_logging("debug", stream=stream)
    setup_logging("info", stream=stream)  # a rerun replaces, never doubles
    assert root_logger.level == logging.INFO
    logging.getLogger("lmtier.sidecar.x").debug("hidden")
    logging.getLogger("lmtier.sidecar.x").info("shown %s", f"Bearer {TOKEN}")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0])["msg"] == "shown Bearer **********"


def test_setup_logging_text(root_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)  # the default stream is the current stderr
    setup_logging("WARNING", json=False)
    logging.getLogger("lmtier.sidecar.x").warning("careful")
    assert stream.getvalue().rstrip().endswith("WARNING lmtier.sidecar.x: careful")


def test_setup_logging_refuses_unknown_levels(root_logger: logging.Logger) -> None:
    with pytest.raises(ConfigError, match="log level 'loud' is not one of critical, error"):
        setup_logging("loud")


def grpc_decode_error(value: bytes) -> None:
    """What grpcio logs for a metadata value that is not UTF-8 (grpc_string.pyx.pxi)."""
    try:
        value.decode()
    except UnicodeDecodeError:
        logging.getLogger("grpc._cython.cygrpc").exception("Invalid encoding on %s", value)


@pytest.mark.parametrize("level", ["info", "debug"])
def test_grpc_logging_a_metadata_value_is_one_debug_line_without_it(
    root_logger: logging.Logger, level: str
) -> None:
    """A client without a token can make grpcio log any metadata value (a token with
    no scheme, in another header) at ERROR with a traceback."""
    stream = io.StringIO()
    setup_logging(level, stream=stream)
    setup_logging(level, stream=stream)  # the filter is added once
    grpc_decode_error(f"Basic {TOKEN}\xe9".encode("latin-1"))
    logging.getLogger("grpc._cython.cygrpc").error("something else %s", "kept")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert TOKEN not in stream.getvalue()
    assert lines[-1] == {**lines[-1], "level": "ERROR", "msg": "something else kept"}
    noise = lines[:-1]
    if level == "info":
        assert noise == []
    else:
        (line,) = noise
        assert line["level"] == "DEBUG" and "exc" not in line
        assert line["msg"] == "grpc: a request's metadata or method is not UTF-8 (value not logged)"
