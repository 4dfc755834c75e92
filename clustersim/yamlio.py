"""Read YAML into pydantic models, turning every failure into one ConfigError line."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml

from .errors import ConfigError

M = TypeVar("M", bound=pydantic.BaseModel)


class Strict(pydantic.BaseModel):
    """Base for every config section: unknown keys are errors (a typo must not pass silently)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


def read_yaml(path: Path, *, what: str) -> dict[str, Any]:
    """Parse a YAML mapping from ``path``; missing files and syntax errors become ConfigError."""
    if not path.is_file():
        raise ConfigError(f"{what} file not found", source=str(path))
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not a text file (byte {exc.start} is not UTF-8); a {what} is YAML text",
                          source=str(path)) from None
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} file: {exc.strerror or exc}", source=str(path)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else None
        raise ConfigError(f"invalid YAML: {getattr(exc, 'problem', exc)}", source=str(path), field=where) from None
    if data is None:
        raise ConfigError(f"the {what} file is empty", source=str(path))
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping at the top level, got {type(data).__name__}", source=str(path))
    return data


def _field_path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def validate(model: type[M], data: Any, *, source: str, prefix: str = "") -> M:
    """``model.model_validate(data)`` with the first error reported as ``source: field: msg``."""
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        field = _field_path(((prefix,) if prefix else ()) + loc) or None
        kind = err["type"]
        if kind == "extra_forbidden":
            msg = "unknown key (check the spelling; see docs/reference.md)"
        elif kind == "missing":
            msg = "required key is missing"
        else:
            msg = err["msg"].removeprefix("Value error, ")
            if "input" in err and kind not in ("value_error", "assertion_error") and not isinstance(err["input"], dict):
                msg += f" (got {err['input']!r})"
        raise ConfigError(msg, source=source, field=field) from None
