"""User-facing errors: one line that names the file and the field."""

from __future__ import annotations


class ConfigError(Exception):
    """Bad user input. Printed as ``<file>: <field>: <message>``; the CLI exits with 2.

    Example::

        scenarios/x.yaml: parallel.tp: tp=3 does not divide model.heads=64
    """

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None,
                 bad_value: bool = False):
        self.source = source
        self.field = field
        self.message = message
        # the field's value is not one it takes whatever the rest says (its type, range or
        # choices), as opposed to a rule between fields: a sweep refuses such a value at once
        self.bad_value = bad_value
        super().__init__(self.line())

    def line(self) -> str:
        """The one line printed, :func:`printable` (a newline in a file's name, an escape
        sequence in a value quoted back)."""
        parts = [p for p in (self.source, self.field) if p]
        return printable(": ".join(parts + [self.message]))


def printable(text: str) -> str:
    """``text`` with what a terminal would act on escaped as in Python (``\\x1b``, ``\\r``,
    ``\\n``, ``\\u202e``...): printed as written, on its line (error lines, the summary's name
    and description)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(text))


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, ``timeout``, Slurm), raised where it arrives as Ctrl-C's
    KeyboardInterrupt is (:func:`raise_terminated`, installed by the command line): the run
    stops as it does on Ctrl-C, its temp folder and forked processes gone, and exits with 143."""


def raise_terminated(signum, frame) -> None:
    """The SIGTERM handler of ``python -m clustersim``: raise :class:`Terminated`."""
    raise Terminated
