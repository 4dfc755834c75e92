"""The command line the fuzz scripts share: up to two counts after the script's name, each
with its default (``python bench/fuzz_plans.py 3 100``: seed 3, 100 plans)."""

from __future__ import annotations

import argparse


def two_counts(doc: str, first: tuple[str, int, str], second: tuple[str, int, str],
               option: tuple[str, tuple[str, ...], str] | None = None) -> tuple:
    """The two counts given on the command line; ``first`` and ``second`` are (name, default,
    what it is), and the script's ``doc`` gives the help's first paragraph. ``option``
    (``--name``, its choices, the first the default, what it is) adds that option's value
    after them."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0].replace("\n", " "))
    for name, default, what in (first, second):
        ap.add_argument(name, nargs="?", type=int, default=default, help=f"{what} (default {default})")
    if option is not None:
        flag, choices, what = option
        ap.add_argument(flag, choices=choices, default=choices[0], help=f"{what} (default {choices[0]})")
    args = ap.parse_args()
    got = (getattr(args, first[0]), getattr(args, second[0]))
    return got if option is None else (*got, getattr(args, option[0].lstrip("-")))
