"""The ``fqnckpt`` command line (``main``: inspect, migrate, verify, diff) and ``fqnckpt demo`` (``demo``)."""

from .main import build_parser, main, register_command

__all__ = ["build_parser", "main", "register_command"]
