"""Structured logs: one JSON object per line on stderr. Called by the daemon and the CLI."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

LOGGER_NAME = "ditserve.cachectl"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(level: int = logging.INFO) -> logging.Logger:
    """Send the cache's logs (and uvicorn's) to stderr as JSON lines."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    for name in (LOGGER_NAME, "uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(level)
        lg.propagate = False
    return logging.getLogger(LOGGER_NAME)


def event(logger: logging.Logger, name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log ``name`` with ``fields`` as top-level JSON keys."""
    logger.log(level, name, extra={"fields": fields})
