"""Logging set-up for the long-running commands: lines of text, or JSON lines (``--log-format
json``) that a log collector reads field by field."""

from __future__ import annotations

import json
import logging
import time

TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s: %(message)s"


class JsonLines(logging.Formatter):
    """One JSON object a record: time (ISO 8601, UTC), level, logger, message, and the
    exception's traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(quiet: bool = False, fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO, handlers=[handler], force=True
    )
