"""User-facing errors: one line that names the file and the field."""

from __future__ import annotations


class ConfigError(Exception):
    """Bad user input. Printed as ``<file>: <field>: <message>``; the CLI exits with 2.

    Example::

        scenarios/x.yaml: parallel.tp: tp=3 does not divide model.heads=64
    """

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None):
        self.source = source
        self.field = field
        self.message = message
        super().__init__(self.line())

    def line(self) -> str:
        parts = [p for p in (self.source, self.field) if p]
        return ": ".join(parts + [self.message])
