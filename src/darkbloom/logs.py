"""One log format for every process: time, level, logger, message (never prompt text)."""

from __future__ import annotations

import logging
import os


def configure_logging() -> None:
    level = os.environ.get("DARKBLOOM_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # What the format does not show is not gathered for each record (the logging documentation's
    # "Optimization"): the caller's file and line, thread, process and asyncio task.
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging.logAsyncioTasks = False  # type: ignore[attr-defined]  (3.12+; harmless before)
