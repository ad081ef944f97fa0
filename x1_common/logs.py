"""Logging set-up shared by every command: one format, and secrets redacted on the way out."""

from __future__ import annotations

import logging
import sys

from x1_common.contracts import redact


class RedactSecrets(logging.Filter):
    """Replaces any secret value from the environment (API keys, webhook URLs, passwords)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


def setup_logging(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    handler.addFilter(RedactSecrets())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "urllib3", "alembic", "mlflow", "apscheduler"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
