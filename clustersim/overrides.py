"""Changes to a scenario given on the command line: ``KEY=VALUE`` with a dotted key.

``compare``, ``sweep`` and ``advise`` make plans out of one scenario file this way, without a
file per plan (from Python: :func:`load_variant`)::

    parallel.pp=1 parallel.dp=8 parallel.zero=3     three changes, one plan
    parallel.layers_per_stage=[2,4,4,2]              a value is read as YAML (a list here)
    training.recompute_layers=null                   null removes the key: its default again

A key names a field as the scenario's YAML nests it (``parallel.zero``, ``model.moe.top_k``);
sections missing from the file are made. What the change leads to is checked as the file is,
so a bad value is refused by the field it names.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError
from .yamlio import read_yaml, short_repr

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def parse_changes(text: str, *, source: str, field: str) -> list[tuple[str, Any]]:
    """``"parallel.pp=1 parallel.zero=3"`` as ``[("parallel.pp", 1), ("parallel.zero", 3)]``:
    changes split as a shell splits words (quote a value with spaces), each value read as YAML.
    A ConfigError names ``source`` and ``field`` (the option that gave them)."""
    try:
        words = shlex.split(text)
    except ValueError as exc:  # an unclosed quote
        raise ConfigError(f"{short_repr(text)}: {exc}", source=source, field=field) from None
    if not words:
        raise ConfigError("is empty: give changes as KEY=VALUE (e.g. parallel.zero=3)", source=source, field=field)
    out = []
    for i, word in enumerate(words):
        key, eq, raw = word.partition("=")
        check_key(key if eq else "", source=source, field=field, what=word, hint=_stray_space(words, i))
        try:
            value = parse_value(key, raw, source=source, field=field)
        except ConfigError as exc:
            if len(words) == 1:
                raise
            # most likely a value with spaces split into words: say how to keep it whole
            raise ConfigError(f"{exc.message}; quote a value with spaces inside the changes, e.g. "
                              f"\"'{key}=[a, b]'\"", source=source, field=field) from None
        if any(k == key for k, _ in out):
            raise ConfigError(f"{key} is changed twice", source=source, field=field)
        out.append((key, value))
    return out


def check_key(key: str, *, source: str, field: str, what: str, hint: str = "") -> None:
    """Refuse ``key`` unless it is a dotted key (``parallel.zero``); ``what``: the whole word,
    ``hint``: what the refusal adds (:func:`_stray_space`)."""
    if not _KEY.fullmatch(key):
        raise ConfigError(f"{short_repr(what)} is not KEY=VALUE with a dotted key (e.g. parallel.zero=3){hint}",
                          source=source, field=field)


def _stray_space(words: list[str], i: int) -> str:
    """Where the word ``words[i]``, not a change, is one split off by a space beside its ``=``
    (``parallel.tp= 4``, ``parallel.tp =4``, ``parallel.tp = 4``): what to write instead,
    to end the refusal with; else ""."""
    word = words[i]
    if i > 0 and words[i - 1].endswith("=") and _KEY.fullmatch(words[i - 1][:-1]) and "=" not in word:
        whole = words[i - 1] + word
    elif i + 1 < len(words) and words[i + 1].startswith("=") and _KEY.fullmatch(word):
        whole = word + words[i + 1] + (words[i + 2] if words[i + 1] == "=" and i + 2 < len(words) else "")
    else:
        return ""
    return f"; a space beside the = splits a change in two: write {shlex.quote(whole)}"


def parse_value(key: str, raw: str, *, source: str, field: str) -> Any:
    """``raw`` read as a YAML value (an empty one as ""), or a ConfigError naming ``key``."""
    from .yamlio import load_unique  # (exponent numbers read as YAML 1.2 reads them, as in a scenario file)

    try:
        return load_unique(raw, source) if raw.strip() else ""
    except ConfigError as exc:
        raise ConfigError(f"{key}: {exc.message}", source=source, field=field) from None
    except yaml.YAMLError as exc:
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise ConfigError(f"{key}: {short_repr(raw)} is not a YAML value ({problem})", source=source,
                          field=field) from None


# under these the scenario changes its topology's fields (config.topology_changes): null there
# is kept, as it is in the file, and sets the topology's field to null (its default); removed,
# it would leave the topology file's value
_NULL_KEPT = ("cluster.node.", "cluster.fabric.")


def apply_changes(data: dict[str, Any], changes: list[tuple[str, Any]], *, source: str) -> dict[str, Any]:
    """A deep copy of the scenario ``data`` with ``changes`` made: each dotted key set (None:
    removed, but kept as null under ``cluster.node`` and ``cluster.fabric``), the mappings on
    its way made where missing. A key that runs through a value which is not a mapping is
    refused (ConfigError naming the key)."""
    out = copy.deepcopy(data)
    for key, value in changes:
        keep_null = value is None and key.startswith(_NULL_KEPT)
        *path, last = key.split(".")
        node = out
        for i, part in enumerate(path):
            nxt = node.get(part)
            if nxt is None:
                if value is None and not keep_null:  # removing a key under a section not there: nothing to do
                    break
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                where = ".".join(path[:i + 1])
                raise ConfigError(f"{where} is {short_repr(nxt)}, not a section with keys; {key} cannot be set",
                                  source=source, field=key)
            node = nxt
        else:
            if value is None and not keep_null:
                node.pop(last, None)
            else:
                node[last] = value
    return out


def change_words(changes: list[tuple[str, Any]]) -> list[str]:
    """Each change as ``KEY=VALUE``, its value a YAML flow value (``cluster.what_if=[{gpu:
    5, slowdown: 1.2}]``)."""
    return [f"{k}={_flow(v)}" for k, v in changes]


def changes_text(changes: list[tuple[str, Any]]) -> str:
    """The changes as the command line gives them, one ``KEY=VALUE`` each (YAML flow values,
    quoted as a shell would need where they hold spaces): :func:`parse_changes` reads it back."""
    return " ".join(map(_shell_word, change_words(changes)))


def _shell_word(word: str) -> str:
    """``word`` as a shell reads it back: in double quotes where it holds a single quote and
    nothing a shell expands within double quotes (YAML's quoted keys: "{'gpu:3': null}"),
    else as :func:`shlex.quote` gives it (which spells a single quote '"'"')."""
    if "'" in word and not any(c in word for c in '"$`\\!'):
        return f'"{word}"'
    return shlex.quote(word)


def _flow(value: Any) -> str:
    if value is None:
        return "null"
    if value == "":
        return '""'
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()


def variant_source(path: str | Path, changes: list[tuple[str, Any]]) -> str:
    """What error messages name a variant by: ``scenarios/x.yaml with parallel.pp=1 ...``."""
    return f"{path} with {changes_text(changes)}"


def repeats(items: list[Any]) -> list[Any]:
    """The items equal to one before them, in order (``[]`` where none is): a key changed or
    varied twice, a value given twice."""
    return [x for i, x in enumerate(items) if x in items[:i]]


def given_changes(changes: Any, what: str = "load_variant's changes") -> list[tuple[str, Any]]:
    """Changes given from Python as (key, value) pairs: as such, as a dict, or as ``run
    --set``'s text (:func:`parse_changes`); TypeError naming ``what`` for anything else, and a
    ConfigError for a key given twice, as ``--set`` refuses it."""
    if isinstance(changes, str):
        return parse_changes(changes, source="<python>", field=what)
    if isinstance(changes, dict):
        return list(changes.items())
    pairs = list(changes) if isinstance(changes, (list, tuple)) else None
    if pairs is None or not all(isinstance(c, (list, tuple)) and len(c) == 2 and isinstance(c[0], str) for c in pairs):
        raise TypeError(f"{what} are (key, value) pairs, e.g. [(\"parallel.tp\", 4)], a dict of them or "
                        f"\"parallel.tp=4 ...\" text, not {short_repr(changes)}")
    twice = repeats([k for k, _ in pairs])
    if twice:  # (as run --set refuses it: the last value would win unsaid)
        raise ConfigError(f"{twice[0]} is changed twice", source="<python>", field=what)
    return [(k, v) for k, v in pairs]


def load_variant(path: str | Path, changes: list[tuple[str, Any]], data: dict[str, Any] | None = None,
                 unnamed: list[tuple[str, Any]] = (), check_schedule: bool = True):
    """The scenario of the file ``path`` (its contents ``data`` where read already) with
    ``changes`` made (:func:`given_changes`: pairs, a dict, or ``run --set``'s text), then
    ``unnamed`` (changes the error messages do not list: ``compare``'s name and description
    of a variant), validated as the file is (relative paths from the
    file's folder; ``check_schedule`` as :func:`clustersim.config.load_scenario`'s); a
    ConfigError names the variant (:func:`variant_source`)."""
    from .config import load_scenario

    if not isinstance(path, (str, os.PathLike)):  # (a caller's mistake: Path() said "expected str, ... not dict")
        raise TypeError(f"load_variant takes a scenario file's path, not {type(path).__name__}; a dict's changes "
                        "are made in the dict, then clustersim.load_scenario(the dict, base_dir=...)")
    changes = given_changes(changes)
    source = variant_source(path, changes)
    data = read_yaml(Path(path), what="scenario") if data is None else data
    folder = Path(path).parent
    made = [(k, shell_path(v, folder) if k in PATH_KEYS else v) for k, v in changes]
    try:
        return load_scenario(apply_changes(data, made + list(unnamed), source=source), base_dir=folder,
                             source=source, check_schedule=check_schedule)
    except ConfigError as exc:
        joined = _joined_changes(exc.field, dict(changes).get(exc.field))
        if joined:
            raise ConfigError(f"{exc.message}; {joined}", source=exc.source, field=exc.field,
                              bad_value=exc.bad_value) from None
        given = dict(changes).get(exc.field) if exc.field in PATH_KEYS else None
        if isinstance(given, str) and given == dict(made)[exc.field] and "not found" in exc.message \
                and not Path(given).is_absolute() and not given.startswith("~"):  # (looked for in both places)
            here = Path(given).resolve()
            tail = (f"; from the working folder it is a folder ({here}): give the file in it" if here.is_dir()
                    else f", nor from the working folder ({here})")
            raise ConfigError(f"{exc.message}{tail}", source=exc.source, field=exc.field,
                              bad_value=exc.bad_value) from None
        raise


# a change joined to the one before it by a comma or a semicolon, inside that one's value
_JOINED = re.compile(r"\s*[,;]\s*(?=[A-Za-z_]\w*(?:\.\w+)+=)")


def _joined_changes(key: str | None, value: Any) -> str:
    """Where ``value``, refused for ``key``, holds more changes after a comma or a semicolon
    (``--set "parallel.tp=4,parallel.dp=2"``: tp given '4,parallel.dp=2'), or ends with one
    (``"parallel.tp=4; parallel.dp=2"``: '4;'), how to write them; else ""."""
    if not isinstance(value, str) or not key:
        return ""
    said = "changes are separated by spaces, not commas or semicolons"
    if _JOINED.search(value):
        return f"{said}: {shlex.quote(_JOINED.sub(' ', f'{key}={value}'))}"
    if len(value) > 1 and value.rstrip()[-1:] in (",", ";"):
        return f"{said}: drop the {value.rstrip()[-1]!r} after {shlex.quote(f'{key}={value.rstrip()[:-1]}')}"
    return ""


# the scenario's fields that name a file, relative to the scenario's folder in the file
PATH_KEYS = ("cluster.topology", "parallel.schedule_file")


def shell_path(value: Any, folder: Path) -> Any:
    """A file a change names (``--set cluster.topology=topologies/dgx-a100.yaml``), typed in a
    shell: where it is no file beside the scenario (``folder``) but one from the working
    folder, that one, as an absolute path; else as given (relative to the scenario's folder,
    as the file's own paths are)."""
    if not isinstance(value, str) or not value or Path(value).is_absolute() or value.startswith("~"):
        return value
    if not (folder / value).is_file() and Path(value).is_file():
        return str(Path(value).resolve())
    return value
