"""Read YAML into pydantic models, turning every failure into one ConfigError line."""

from __future__ import annotations

import datetime
import errno
import functools
import math
import os
import re
import reprlib
import stat
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args, get_origin

import pydantic
import pydantic_core
import yaml

from .errors import ConfigError

M = TypeVar("M", bound=pydantic.BaseModel)

# Scenario and topology files are a few KB; the pure-Python YAML parser reads 45-200 KB/s
# (slowest on a flow list of small numbers), so a larger file is refused before it is parsed:
# at most ~1.5 s of parsing (the long fuzz run's bound is 5 s an example).
MAX_YAML_BYTES = 64 * 1024

# Flow collections ([ ] and { }) nested deeper than this are refused before parsing: the
# parser's scan of a deep run of [ [ [ costs O(depth) a token (about 1.5 s for 1,000 levels)
# before it fails with a RecursionError; the files here nest three or four levels.
MAX_FLOW_NESTING = 64
_QUOTED_OR_COMMENT = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"\\]|\\.)*\"|(?:^|(?<=\s))#[^\n]*", re.MULTILINE)

# Values quoted back in error messages: short, whatever the input (an alias bomb's billion
# items, a megabyte string, a 400-digit number)
_short = reprlib.Repr()
_short.maxstring = _short.maxother = _short.maxlong = 60
_short.maxlist = _short.maxtuple = _short.maxdict = _short.maxset = 4
_short.maxlevel = 2


def not_a_file(path: Path) -> str:
    """What ``path``, which is not a regular file, is instead: "not found", "a folder", "a
    symlink loop", "a character device, not a regular file" (/dev/null), ... (for messages)."""
    try:
        mode = os.stat(path).st_mode
    except ValueError as exc:  # (a NUL character, or half a surrogate pair, which no system call takes)
        return "a name holding a NUL character" if "\0" in str(path) else f"not readable: {exc}"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symlink loop"
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return "a link to nothing" if os.path.islink(path) else "not found"
        return f"not readable: {exc.strerror or exc}"
    if stat.S_ISDIR(mode):
        return "a folder"
    kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
            else "a pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "something")
    return f"{kind}, not a regular file"


def given_file(name: str, *, what: str, source: str, field: str, base: Path | None = None,
               shown: str | None = None) -> Path:
    """The regular file ``name`` names (relative to ``base`` where given: a file a scenario
    names); a ConfigError naming ``field`` (an option, a scenario's key) if the name is empty
    or names something else, a value refused alone (``bad_value``: no other field makes it a
    file). ``shown``: how messages name it (default: its path)."""
    if not name:  # (Path("") is the current folder)
        raise ConfigError(f"the {what} file's path is empty", source=source, field=field, bad_value=True)
    if "\0" in name:  # (the operating system's calls refuse it with a ValueError)
        raise ConfigError(f"the {what} file's path {short_repr(name)} holds a NUL character", source=source,
                          field=field, bad_value=True)
    path = Path(name) if base is None else base / name
    where = str(path) if shown is None else shown
    try:
        if path.is_file():
            return path
        kind = not_a_file(path)
    except OSError as exc:  # e.g. a name too long for the file system
        raise ConfigError(f"cannot read {what} file {where}: {exc.strerror or exc}", source=source,
                          field=field, bad_value=True) from None
    if kind == "not found":
        raise ConfigError(f"{what} file not found: {where}", source=source, field=field, bad_value=True)
    hint = "; give the file in it" if kind == "a folder" else ""
    raise ConfigError(f"{what} file {where} is {kind}{hint}", source=source, field=field, bad_value=True)


def short_repr(value: Any) -> str:
    """``repr(value)``, cut to a few dozen characters (for error messages)."""
    return _short.repr(value)


# the kind of error of a value refused on its own (a number quoted, a boolean for a number),
# which ConfigError.bad_value counts with pydantic's own kinds (a sweep refuses it at once)
VALUE_ALONE = "value_alone"


def refused_alone(why: str) -> pydantic_core.PydanticCustomError:
    """What a validator raises for a value its field never takes, whatever the other fields
    (``ConfigError.bad_value``: a sweep refuses it before any plan runs)."""
    return pydantic_core.PydanticCustomError(VALUE_ALONE, "{why}", {"why": why})


@functools.lru_cache(maxsize=None)
def _kinds(section: type, field: str) -> frozenset:
    """The types a field's annotation takes, its unions and list items unfolded (once per
    field: every value a sweep's thousands of plans validate asks)."""
    kinds, seen = set(), [section.model_fields[field].annotation]
    while seen:
        t = seen.pop()
        origin, args = get_origin(t), get_args(t)
        if origin is Annotated:  # a constrained type (PositiveFloat): its type, not its constraints
            seen.append(args[0])
        elif origin is Literal:  # a choice of values (fabric.tiers: 2 or 3): their types
            kinds.update(map(type, args))
        elif args:
            seen += args
        else:
            kinds.add(t)
    return frozenset(kinds)


class Strict(pydantic.BaseModel):
    """Base for every config section: unknown keys are errors (a typo must not pass silently),
    and so are infinite and NaN numbers (``.inf`` in YAML: no figure of a cluster, model or
    plan is infinite)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @pydantic.field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, v: Any, info: pydantic.ValidationInfo) -> Any:
        """YAML reads ``yes``, ``no``, ``true`` and ``on`` as booleans, and pydantic would take
        them as 1 and 0: ``tp: yes`` must not run TP 1."""
        if info.field_name is None:
            return v
        items = v if isinstance(v, list) else [v]  # a list of numbers' items too (layers_per_stage)
        if any(isinstance(x, (bool, str, int, float)) for x in items):
            kinds = _kinds(cls, info.field_name)
            if bool not in kinds and kinds & {int, float} and any(isinstance(x, bool) for x in items):
                raise refused_alone("a number, not a boolean (yes, no, true and false are booleans in YAML)")
            # pydantic would read '8' as 8: a number quoted is a slip (a field of numbers only
            # takes numbers); a word ('four') is left to pydantic's own message
            if kinds & {int, float} and kinds <= {int, float, type(None)}:
                quoted = next((x for x in items if isinstance(x, str) and _numeric(x)), None)
                if quoted is not None and _LEADING_ZERO.fullmatch(quoted.strip()):
                    raise refused_alone(f"a number, not a string ({short_repr(quoted)}: a leading zero, which "
                                         f"YAML 1.1 reads as text, quoted or not; write it without the zero)")
                if quoted is not None:
                    # (the value alone, not how it was written: '4' and !!str 4 load alike; a
                    # digit outside ASCII, full-width 4 unquoted, loads as text too)
                    why = ("quoted, or tagged !!str" if quoted.isascii() else
                           "YAML reads numbers written in ASCII digits only")
                    raise refused_alone(f"a number, not a string ({short_repr(quoted)}: {why})")
            # pydantic would read 'false', 'off' or '0' as False: a switch takes true or false
            if bool in kinds and kinds <= {bool, type(None)} and any(isinstance(x, str) for x in items):
                quoted = next(x for x in items if isinstance(x, str))
                raise refused_alone(f"true or false, not a string ({short_repr(quoted)})")
            # and pydantic would read 0 and 1 as False and True: ``bias: 0`` is a slip too
            if bool in kinds and kinds <= {bool, type(None)} and any(
                    isinstance(x, (int, float)) and not isinstance(x, bool) for x in items):
                number = next(x for x in items if isinstance(x, (int, float)) and not isinstance(x, bool))
                raise refused_alone(f"true or false, not a number ({short_repr(number)})")
        if v is None:
            # ``parallel:`` with nothing under it reads as null in YAML: a section left empty
            # takes its defaults, as one left out does (a field that may be null stays null)
            f = cls.model_fields[info.field_name]
            if not f.is_required() and _is_model(f.annotation):
                return {}
            if not f.is_required() and get_origin(f.annotation) is list:  # (a list that may not be null)
                return []
        return v


def _numeric(text: str) -> bool:
    """Whether ``text`` reads as a number (``'8'``, ``' 1e3'``; not ``'four'``, ``'nan'``)."""
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _flow_nesting(text: str) -> int:
    """How deep ``[`` and ``{`` nest outside quoted strings and comments (an estimate from the
    characters alone: exact for flow collections, counting a bracket inside a plain scalar too)."""
    if text.count("[") + text.count("{") <= MAX_FLOW_NESTING:
        return 0
    depth = deepest = 0
    for ch in _QUOTED_OR_COMMENT.sub("", text):
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


_MERGE_TAG = "tag:yaml.org,2002:merge"


# plain scalars YAML 1.1 reads as numbers other than the ones written: 010 is octal 8, 1:30 is
# base 60 (90); YAML 1.2 and JSON read neither so. (08192 and 08:30 are text to YAML 1.1: they load
# as written, and where a number goes the check of quoted numbers names them.)
_LEADING_ZERO = re.compile(r"[-+]?0[0-9_]+")
_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
# a ratio written as a switch's sheet writes it, "2:1" (an oversubscription), where the field
# takes the one number
_RATIO = re.compile(r"[0-9]+(\.[0-9]+)?:1")


def _scalar_problem(node: yaml.ScalarNode) -> str | None:
    """Why a scalar cannot be read as written, or None. A double-quoted pair of surrogate
    escapes (``"\\ud83d\\ude80"``, as JSON writes an emoji) is joined into its character here."""
    v = node.value
    if node.tag in _NUMBER_TAGS:  # (an explicit !!str tag is text; a quoted one tagged !!int is not)
        if ":" in v:
            value = 0.0
            for part in v.lstrip("+-").replace("_", "").split(":"):
                value = value * 60 + float(part)
            ratio = f" (a ratio such as an oversubscription is one number: {v} is {v[:-2]})" if _RATIO.fullmatch(v) else ""
            return (f"{v} is a base-60 number in YAML 1.1 ({'-' if v.startswith('-') else ''}{value:g}); quote it "
                    f"for text, or write the number itself{ratio}")
        if _LEADING_ZERO.fullmatch(v):
            return (f"{v} has a leading zero, which YAML 1.1 reads as an octal number; quote it for text, or "
                    f"write it without the zero")
    if any("\ud800" <= c <= "\udfff" for c in v):
        try:
            node.value = v.encode("utf-16", "surrogatepass").decode("utf-16")
        except UnicodeDecodeError:
            return "holds a lone surrogate escape (half of a character written as two \\u escapes)"
    return None


# scalar types whose construction can fail on an explicitly tagged value (!!int four)
_BUILT_TAGS = frozenset(f"tag:yaml.org,2002:{t}" for t in ("int", "float", "bool", "timestamp", "binary"))


def _unbuilt(node: yaml.ScalarNode, exc: Exception) -> str:
    """Why YAML cannot build a tagged scalar (for messages)."""
    return f"{short_repr(node.value)} is not a valid !!{node.tag.rsplit(':', 1)[-1]}, which its tag asks for"


# optional sections that read as null, and so as left out, when written with nothing under them
_SECTIONS_NOT_EMPTY = {"moe": "is empty; give its keys (experts, top_k, expert_ffn; docs/reference.md) or leave it "
                              "out for a dense model"}


def _first_problem(root: yaml.Node | None, loader: yaml.SafeLoader) -> tuple[str, int, str] | None:
    """The first thing in the document, by line, that would load as something other than
    what was written, as (field path, line, why), or None:

    - a key given twice in one mapping: YAML loaders keep the last value silently, so ``tp: 2``
      ... ``tp: 4`` would simulate tp=4 without a word. Keys are compared as loaded (``1`` and
      ``0x1``, ``yes`` and ``true`` are the same key, as in the dict YAML gives). Merge keys
      (``<<``) may override, as YAML intends; what they merge in is not checked, but a second
      ``<<`` in one mapping is refused (keys are unique in YAML; PyYAML merges both, the
      second winning);
    - a number YAML 1.1 reads otherwise (:func:`_scalar_problem`), or a lone surrogate escape;
    - ``moe:`` with nothing under it, which would load as no MoE (``_SECTIONS_NOT_EMPTY``).

    Walked with a stack and each node once (aliases share nodes: an alias bomb stays small)."""
    stack: list[tuple[yaml.Node, tuple]] = [(root, ())] if root is not None else []
    seen_nodes: set[int] = set()
    found: tuple[int, str, str] | None = None

    def note(line: int, where: tuple, why: str) -> None:
        nonlocal found
        if found is None or line < found[0]:
            found = (line, _field_path(where), why)

    while stack:
        node, where = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            merges = 0
            for key, value in node.value:
                if key.tag == _MERGE_TAG:
                    merges += 1
                    if merges == 2:
                        note(key.start_mark.line + 1, (*where, "<<"), "merge key given twice in one mapping (keys "
                             "are unique in YAML; PyYAML merges both, the second winning): merge a list instead, "
                             "<<: [*b, *a], in which the first named wins")
                    stack.append((value, where))
                    continue
                name = "?"
                if isinstance(key, yaml.ScalarNode):
                    why = _scalar_problem(key)  # (a key's surrogate pair joined too, before it names the field)
                    name = key.value
                    if why is not None:
                        note(key.start_mark.line + 1, (*where, name), why)
                        continue
                    try:
                        k = loader.construct_object(key)
                    except (ValueError, KeyError, IndexError, TypeError) as exc:
                        note(key.start_mark.line + 1, (*where, name), _unbuilt(key, exc))
                        continue
                    try:
                        hash(k)
                    except TypeError:
                        k = (key.tag, key.value)
                    line = key.start_mark.line + 1
                    if k in first:
                        note(line, (*where, name), f"key given twice (line {line}, first on line {first[k]}); YAML "
                                                   "would keep only the last silently")
                    first.setdefault(k, line)
                    if name in _SECTIONS_NOT_EMPTY and isinstance(value, yaml.ScalarNode) and value.value == "" \
                            and value.style is None:  # ``moe:`` with nothing under it: null, a dense model
                        note(line, (*where, name), _SECTIONS_NOT_EMPTY[name])
                stack.append((value, (*where, name)))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, (*where, i)) for i, item in enumerate(node.value))
        elif isinstance(node, yaml.ScalarNode):
            why = _scalar_problem(node)
            if why is None and node.tag in _BUILT_TAGS:
                try:  # (an explicit tag on a value its type cannot take: !!int four)
                    loader.construct_object(node)
                except (ValueError, KeyError, IndexError, TypeError) as exc:
                    why = _unbuilt(node, exc)
            if why is not None:
                note(node.start_mark.line + 1, where, why)
    return None if found is None else (found[1], found[0], found[2])


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading exponent numbers as YAML 1.2 and JSON do: PyYAML follows
    YAML 1.1, whose floats need a dot and a signed exponent, so ``4e7``, ``15e-1`` and
    ``1.5e3`` came back as strings (and were then refused as quoted numbers)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def load_unique(text: str, source: str) -> Any:
    """``yaml.safe_load(text)`` (exponent numbers read as YAML 1.2 reads them: :class:`_Loader`),
    refusing a key given twice in one mapping (ConfigError)."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        problem = _first_problem(node, loader)
        if problem is not None:
            field, _, why = problem
            raise ConfigError(why, source=source, field=field or None)
        return loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()


# a block mapping's entry with no space after its colon ("  tp:4"): YAML reads it as a plain
# scalar, and the entries after it then fail ("mapping values are not allowed here")
_NO_SPACE_KEY = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*):(\S.*)$")


def _spaced_key(text: str) -> str | None:
    """"tp: 4" where ``text`` reads as a key and a value with no space between them ("tp:4";
    a URL's "http://" aside), else None."""
    m = _NO_SPACE_KEY.match(text)
    return f"{m[1]}: {m[2].strip()}" if m and not m[2].startswith("//") else None


_BARE_PAIR = re.compile(r"\s*([A-Za-z_][\w.]*)\s+([^\s:#][^:#]*)$")  # "tp 8": a key whose colon is missing
_KEY_AND_VALUE = re.compile(r"\s*[A-Za-z_][\w.]*:\s+[^\s#]")  # "tp: 8", a key holding its value


def _colon_hint(text: str, mark, problem: str = "") -> str:
    """"; line 23 'tp:4': YAML needs a space after a key's colon (tp: 4)", where the line YAML
    stopped at or the one before it is such a key (:func:`_spaced_key`). Where YAML found a
    key it did not expect (``problem``: "mapping values are not allowed here", reported on the
    line after the mistake), the line before it lacking its colon ("tp 8"), or the line
    indented deeper than the key above it, which holds its value already::

        parallel:
         tp: 8        <- one space: pp below is read as more of tp's value
          pp: 4       <- YAML stops here

    "" otherwise."""
    if mark is None:
        return ""
    lines = text.splitlines()
    for n in (mark.line, mark.line - 1):
        if 0 <= n < len(lines) and (fixed := _spaced_key(lines[n].split(" #")[0])):
            return f"; line {n + 1} {short_repr(lines[n].strip())}: YAML needs a space after a key's colon ({fixed})"
    if "mapping values are not allowed" not in problem or not 0 < mark.line < len(lines):
        return ""
    line = lines[mark.line]
    above = next((k for k in range(mark.line - 1, -1, -1)
                  if lines[k].strip() and not lines[k].lstrip().startswith("#")), None)
    if above is None:
        return ""
    prev = lines[above].split(" #")[0].rstrip()
    if m := _BARE_PAIR.fullmatch(prev):
        return (f"; line {above + 1} {short_repr(prev.strip())} has no colon: a key and its value are written "
                f"{m[1]}: {m[2]}")
    indent = len(line) - len(line.lstrip())
    if _KEY_AND_VALUE.match(prev) and indent > len(prev) - len(prev.lstrip()):
        return (f"; line {mark.line + 1} {short_repr(line.strip())} is indented deeper than line {above + 1} "
                f"{short_repr(prev.strip())}, which holds its value: the keys of one section line up")
    return ""
    return ""


def read_yaml(path: Path, *, what: str) -> dict[str, Any]:
    """Parse a YAML mapping from ``path``; missing files and syntax errors become ConfigError."""
    try:
        if path.is_dir():
            raise ConfigError(f"this is a folder; give the {what} file in it", source=str(path))
        if not path.is_file():
            kind = not_a_file(path)
            raise ConfigError(f"{what} file not found" if kind == "not found" else f"this is {kind}; give the {what} "
                              "file", source=str(path))
        size = path.stat().st_size
    except OSError as exc:  # e.g. a name too long for the file system
        raise ConfigError(f"cannot read the {what} file: {exc.strerror or exc}", source=str(path)) from None
    if size > MAX_YAML_BYTES:
        raise ConfigError(f"the {what} file is {size:,} bytes; clustersim reads {what} files of at most "
                          f"{MAX_YAML_BYTES:,} bytes (hand-written ones are a few KB)", source=str(path))
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not a text file (byte {exc.start} is not UTF-8); a {what} is YAML text",
                          source=str(path)) from None
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} file: {exc.strerror or exc}", source=str(path)) from None
    if _flow_nesting(text) > MAX_FLOW_NESTING:
        raise ConfigError(f"invalid YAML: [ ] or {{ }} nested more than {MAX_FLOW_NESTING} levels deep (a {what} "
                          f"nests three or four)", source=str(path))
    try:
        data = load_unique(text, str(path))
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow (its message spans lines)
        ch = f"#x{exc.character:04x}" if isinstance(exc.character, int) else short_repr(exc.character)
        raise ConfigError(f"invalid YAML: character {ch}: {exc.reason}", source=str(path),
                          field=f"line {text.count(chr(10), 0, exc.position) + 1}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else None
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())  # one line
        raise ConfigError(f"invalid YAML: {problem}{_colon_hint(text, mark, problem)}", source=str(path),
                          field=where) from None
    except RecursionError:  # the composer recurses per level, e.g. of a block "- - - - ... x"
        raise ConfigError(f"invalid YAML: nested too deeply (a {what} nests a few levels)",
                          source=str(path)) from None
    if data is None:
        raise ConfigError(f"the {what} file is empty", source=str(path))
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping at the top level, got {type(data).__name__}", source=str(path))
    return data


def _field_path(loc: tuple) -> str:
    """``training.micro_batch_size``, ``what_if[1].gpu``; a key that is not plain printable
    text (an unknown key with a newline, say) is shown quoted and escaped, cut like any value,
    so the message stays one line."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            text = str(part)
            if not text.isprintable() or not text or len(text) > 64:
                text = short_repr(text)
            out += ("." if out else "") + text
    return out


# a rate's unit as its key's suffix says it (a NIC in gigabits, NVLink and PCIe in gigabytes
# per second, as the vendors' sheets give them), and what a rate in the other unit is times
_RATE_UNITS = {"Gbps": ("gigabits", 8.0), "GBps": ("gigabytes", 1 / 8)}


def _percent_note(kind: str, ctx: dict | None, got: Any) -> str:
    """Where a share (at most 1: an efficiency, a fraction) was given as a whole percent (90
    for 0.9), the share it reads as; else ""."""
    if kind == "less_than_equal" and (ctx or {}).get("le") == 1 and isinstance(got, (int, float)) \
            and not isinstance(got, bool) and 2 <= got <= 100 and float(got).is_integer():  # (1.2 reads as no %)
        return f": a share, {got / 100:g} for {got:g} %"
    return ""


def _unit_note(key: str, near: str, value: Any) -> str:
    """Where the unknown key and the near one differ only in a rate's unit (``bw_GBps`` for a
    NIC's ``bw_Gbps``), the near one's unit and the value converted (moved over unchanged it
    would be 8x off); else ""."""
    for unit, (words, times) in _RATE_UNITS.items():
        given = next(u for u in _RATE_UNITS if u != unit)
        if near.endswith(unit) and key == near[:-len(unit)] + given:
            note = f" it is in {words} per second"
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                note += f": {key}: {value:g} is {near}: {value * times:g}"
            return note + ";"
    return ""


def _near_key(model: type[pydantic.BaseModel], loc: tuple) -> str | None:
    """The field of the section at ``loc`` (its last part the unknown key) closest to that
    key in spelling (``paralel`` -> ``parallel``, ``micro_batch`` -> ``micro_batch_size``), if
    one is close (difflib's ratio 0.75 or more, or the key a prefix of just one field)."""
    import difflib

    section = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # an item of a list: its section is the list's
        field_ = section.model_fields.get(part)
        section = _section_in(field_.annotation) if field_ is not None else None
        if section is None:
            return None
    key = str(loc[-1]) if loc else ""
    names = list(section.model_fields)
    near = difflib.get_close_matches(key, names, n=1, cutoff=0.75)
    if near:
        return near[0]
    starting = [n for n in names if key and n.startswith(key)]
    return starting[0] if len(starting) == 1 else None


def _is_model(annotation: Any) -> bool:
    """Whether an annotation is a config section (a pydantic model) itself, not ``list[X]``
    (which Python 3.10 takes for an instance of ``type``: a class has no origin)."""
    return isinstance(annotation, type) and get_origin(annotation) is None and issubclass(annotation,
                                                                                          pydantic.BaseModel)


def _section_in(annotation: Any) -> type[pydantic.BaseModel] | None:
    """The config section (a model) an annotation holds: itself, or inside ``X | None``,
    ``list[X]``, ``dict[str, X]``."""
    if _is_model(annotation):
        return annotation
    for arg in get_args(annotation):
        found = _section_in(arg)
        if found is not None:
            return found
    return None


def _yaml_reading(kind: str, got: Any) -> str:
    """What YAML made of a word or a number where the field wanted other: ``recompute: no`` is
    the boolean false in YAML 1.1, ``name: 2024`` a number (for messages; "" otherwise)."""
    if kind == "literal_error" and isinstance(got, bool):
        return ": YAML reads yes, no, on, off, true and false as booleans; write one of the words above"
    if kind == "string_type" and isinstance(got, (bool, int, float, datetime.date)):
        return ": YAML read it as a number, date or boolean; quote it to give it as text"
    return ""


def _plain_loc(loc: tuple) -> tuple:
    """An error's location without pydantic's validator steps (``function-after[...]``)."""
    return tuple(p for p in loc if not (isinstance(p, str) and p.startswith("function-")))


ALSO_NAMED = 4  # the other refused fields an error's line names before "..."


def _also_refused(errors: list[dict], said: dict, prefix: str, field: str | None) -> str:
    """The other fields pydantic refused besides the one said (``said``), named after its
    message so that a file with several mistakes is not mended one run at a time; a required
    key missing beside an unknown key of its section is left out (the unknown one is most
    likely it misspelt, said with it). "" where there are none::

        model.heads: ... (got '3x'); also refused: parallel.tp, training.micro_batch_size"""
    unknown_in = {_plain_loc(e["loc"])[:-1] for e in errors if e["type"] in ("extra_forbidden", "invalid_key")}
    others: list[str] = []
    for e in errors:
        loc = _plain_loc(e["loc"])
        if e is said or e["type"] == "missing" and loc[:-1] in unknown_in:
            continue
        name = _field_path(((prefix,) if prefix else ()) + loc)
        if name and name != field and name not in others:
            others.append(name)
    if not others:
        return ""
    shown = ", ".join(others[:ALSO_NAMED]) + (f" and {len(others) - ALSO_NAMED} more" if len(others) > ALSO_NAMED else "")
    return f"; also refused: {shown}"


def validate(model: type[M], data: Any, *, source: str, prefix: str = "") -> M:
    """``model.model_validate(data)`` with the first error reported as ``source: field: msg``,
    and the other fields refused named after it (:func:`_also_refused`)."""
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        errors = exc.errors()
        err = errors[0]
        if err["type"] == "missing":
            # a required key that is missing beside an unknown one is most likely it misspelt
            # (``hiden: 8192``): name the unknown key, which says what to write
            err = next((e for e in errors if e["type"] in ("extra_forbidden", "invalid_key")
                        and e["loc"][:-1] == err["loc"][:-1]), err)
        loc = _plain_loc(err["loc"])
        field = _field_path(((prefix,) if prefix else ()) + loc) or None
        kind = err["type"]
        if kind == "extra_forbidden":
            near = _near_key(model, loc)
            msg = (f"unknown key (did you mean {near!r}?{_unit_note(str(loc[-1]), near, err.get('input'))} see "
                   "docs/reference.md)"
                   if near else "unknown key (check the spelling; see docs/reference.md)")
            key = loc[-1] if loc else ""
            if isinstance(key, str) and ":" in key and not key.startswith(":"):
                # ({gpu:3}: YAML reads a colon without a space after it as part of the key)
                name, _, value = key.partition(":")
                msg += f"; YAML needs a space after a key's colon: {name}: {value}"
        elif kind == "missing":
            msg = "required key is missing"
        elif kind == "invalid_key":  # (``1: foo``: pydantic would show the key as a list index)
            key = err.get("input")  # (the key as YAML read it; loc holds True as 1, 2.5 as '2.5')
            what = ("a boolean" if isinstance(key, bool) else "a number" if isinstance(key, (int, float))
                    else "null" if key is None else "something else than text")
            shown = "null" if key is None else "true" if key is True else "false" if key is False else short_repr(key)
            field = _field_path(((prefix,) if prefix else ()) + loc[:-1] + (shown,))  # (named as an unknown key is)
            msg = f"unknown key (YAML read it as {what}; keys are names: see docs/reference.md)"
        elif kind == "model_type" and err.get("input", ...) is None and loc and isinstance(loc[-1], str):
            # ``training:`` with nothing under it (a list's null item keeps pydantic's wording)
            msg = "is empty; this section is required (see docs/reference.md for its keys)"
        else:
            msg = err["msg"].removeprefix("Value error, ")
            got = err.get("input")
            if kind == "int_parsing_size":  # (pydantic's "Unable to parse input string" for a float 1e20)
                msg = "too large for a 64-bit integer"
            elif kind in ("model_type", "dict_type"):  # (pydantic names its class: "instance of DenseModelCfg")
                what = ("a list" if isinstance(got, list) else "a boolean" if isinstance(got, bool) else
                        "a number" if isinstance(got, (int, float)) else "text" if isinstance(got, str) else "a value")
                msg = f"should be keys and values (a mapping), not {what}"
                if isinstance(got, str) and (fixed := _spaced_key(got)):
                    msg += f"; YAML needs a space after a key's colon ({fixed})"
            if "input" in err and kind not in ("value_error", "assertion_error", VALUE_ALONE) and not isinstance(got, dict):
                shown = got.isoformat() if isinstance(got, datetime.date) else short_repr(got)
                ratio = (f": a ratio is one number, {got.strip()[:-2]} for {got.strip()}"
                         if kind == "float_parsing" and isinstance(got, str) and _RATIO.fullmatch(got.strip()) else "")
                msg += f" (got {shown}{_yaml_reading(kind, got)}{_percent_note(kind, err.get('ctx'), got)}{ratio})"
        msg += _also_refused(errors, err, prefix, field)
        # (a validator's ValueError may weigh other fields; pydantic's own kinds judge the value alone)
        raise ConfigError(msg, source=source, field=field,
                          bad_value=kind not in ("value_error", "assertion_error", "missing", "extra_forbidden")) from None
