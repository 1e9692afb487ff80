"""Logs of ``lmtier serve``: one JSON object per line (for log shippers) or plain text.

Every line passes :func:`redact` first, a last line of defence behind
:class:`~lmtier.config.secrets.Secret`: anything shaped like ``Bearer <token>`` in a
message, an ``extra`` value or a traceback is masked, in case a token slipped into an
exception message or a caller's metadata was logged whole.

grpcio itself logs a metadata value that is not UTF-8 whole, at ERROR with a
traceback, before any check of ours runs: a client without a token can send one, and
the value may be a token in any form (no scheme, ``Basic``, a custom header), which no
pattern can find. :class:`GrpcMetadataNoise` turns those records into one DEBUG line
without the value (the call itself is refused: UNAUTHENTICATED or INVALID_ARGUMENT).
"""

from __future__ import annotations

import json as _json
import logging
import re
import sys
from datetime import datetime, timezone
from typing import Any, TextIO

from lmtier.config.secrets import MASK
from lmtier.errors import ConfigError, brief

__all__ = ["GrpcMetadataNoise", "JsonFormatter", "TextFormatter", "redact", "setup_logging"]

_BEARER = re.compile(r"(?i)\b(bearer)(\s+|%20|=|\\t)[^\s\"',;\\]+")
_GRPC_CORE = "grpc._cython.cygrpc"

# The attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(
    vars(logging.LogRecord("", logging.INFO, "", 0, "", None, None)).keys()
    | {"message", "asctime", "taskName"}
)
_HANDLER_NAME = "lmtier.sidecar"  # how a rerun of setup_logging finds its own handler
_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


def redact(text: str) -> str:
    """``text`` with every ``Bearer <token>`` (any case) turned into ``Bearer **********``."""
    return _BEARER.sub(lambda match: f"{match[1]}{match[2]}{MASK}", text)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line.

    Keys: ``ts`` (ISO-8601 UTC with milliseconds, ``2025-01-02T03:04:05.678Z``),
    ``level``, ``logger``, ``msg``, then each ``extra=`` field whose value JSON can
    hold (others are left out rather than stringified: a repr may hold anything),
    and ``exc`` (the traceback) when the record has one. Strings are redacted.
    """

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        stamp = datetime.fromtimestamp(record.created, tz=timezone.utc)
        out: dict[str, Any] = {
            "ts": stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": redact(_message(record)),
        }
        for key, value in vars(record).items():
            if key in _STANDARD or key in out or key.startswith("_"):
                continue
            try:
                _json.dumps(value, allow_nan=False)
            except (TypeError, ValueError):
                continue
            out[key] = _redact_value(value)
        if record.exc_info:
            out["exc"] = redact(self.formatException(record.exc_info))
        elif record.exc_text:
            out["exc"] = redact(record.exc_text)
        if record.stack_info:
            out["stack"] = redact(self.formatStack(record.stack_info))
        return _json.dumps(out, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """Plain text lines (``time level logger: message``), redacted like the JSON ones."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        """The record as redacted text."""
        return redact(super().format(record))


def _redact_value(value: Any) -> Any:
    """``value`` (already known to be JSON-serialisable) with its strings redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, (list, tuple)):
        return [_redact_value(item) for item in value]
    if isinstance(value, dict):
        return {key: _redact_value(item) for key, item in value.items()}
    return value


class GrpcMetadataNoise(logging.Filter):
    """On grpcio's own logger: its "Invalid encoding on b'<value>'" records (a metadata
    value or method name that is not UTF-8, logged whole with a traceback) become a
    DEBUG line that leaves the value out (module docstring); others pass unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite such a record in place; keep it only where DEBUG is logged."""
        if not (isinstance(record.msg, str) and record.msg.startswith("Invalid encoding")):
            return True
        record.msg = "grpc: a request's metadata or method is not UTF-8 (value not logged)"
        record.args, record.exc_info, record.exc_text = None, None, None
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger().isEnabledFor(logging.DEBUG)


def _message(record: logging.LogRecord) -> str:
    """``record.getMessage()``, or a note if its arguments do not fit its format (the
    logging module would print a traceback to stderr and lose the line)."""
    try:
        return record.getMessage()
    except Exception:
        return f"{record.msg!s} (unformattable arguments: {brief(record.args)})"


def setup_logging(level: str, *, json: bool = True, stream: TextIO | None = None) -> None:
    """Send every log record at ``level`` and above to ``stream`` (default: the
    current ``sys.stderr``), as JSON lines or plain text.

    ``level`` is a name (``"info"``, ``"DEBUG"``; any case). Idempotent: a second call
    replaces the handler of the first rather than doubling every line; handlers that
    others installed on the root logger are left alone.
    """
    name = level.strip().upper()
    if name not in _LEVELS:
        raise ConfigError(
            f"log level {brief(level)} is not one of {', '.join(_LEVELS).lower()}",
            key="log_level",
        )
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(JsonFormatter() if json else TextFormatter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(name)
    grpc_core = logging.getLogger(_GRPC_CORE)
    if not any(isinstance(f, GrpcMetadataNoise) for f in grpc_core.filters):
        grpc_core.addFilter(GrpcMetadataNoise())
