"""One log format for every process: time, level, logger, message (never prompt text)."""

from __future__ import annotations

import logging
import os


def configure_logging() -> None:
    level = os.environ.get("DARKBLOOM_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
