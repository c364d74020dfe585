"""The package logger: ``rdkeras: message`` on stderr unless the application configures logging."""

import logging

logger = logging.getLogger("rdkeras")
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("rdkeras: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
