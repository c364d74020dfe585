"""Transports implemented in Python (the native ones live in csrc/transport/)."""
