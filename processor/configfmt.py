"""Typed configuration decoding, in the manner of the Collector's `confmap`.

A configuration section is a dataclass. ``decode`` turns a parsed YAML mapping into it,
checking every key and type, and collects *all* problems with their config paths
(``receivers.otlp.grpc.endpoint: ...``) instead of stopping at the first. A dataclass
may define ``validate(self, path) -> list[Problem]`` for checks across fields; it runs
after decoding.

Values may reference the environment as the Collector does: ``${env:VAR}`` or
``${env:VAR:-default}``; ``$$`` is a literal ``$``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import math
import os
import re
import types
from collections.abc import Mapping
from typing import Any, Literal, NewType, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from processor.errors import Problem

T = TypeVar("T")

# Seconds, written in config as "500ms", "5s", "1h30m", "7d" or a bare number of seconds.
Duration = NewType("Duration", float)
# Bytes, written as "16MiB", "512KiB", "1GB" or a bare integer.
ByteSize = NewType("ByteSize", int)

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h|d|w)")
_DURATION_UNITS = {
    "ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0,
}
# Units of a duration, largest first: a duration names them in this order, each once.
_DURATION_ORDER = ("w", "d", "h", "m", "s", "ms", "us", "µs", "ns")
_SIZE = re.compile(r"(\d+)\s*(B|KB|KiB|MB|MiB|GB|GiB)?", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1, "kb": 1000, "kib": 1024, "mb": 1000**2, "mib": 1024**2, "gb": 1000**3, "gib": 1024**3,
}
# Longest duration a setting may take: ten years, far inside the 64-bit nanosecond range.
MAX_DURATION_S = 10 * 366 * 86400.0
# A configuration file is small; anything larger is a mistake or an attack.
MAX_CONFIG_BYTES = 1024 * 1024

_ENV_REF = re.compile(r"\$\$|\$\{env:([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class DurationError(ValueError):
    """A text that is not a duration. ``reason`` lets a caller word it in its own format's terms."""

    def __init__(self, message: str, reason: Literal["empty", "order", "syntax"]) -> None:
        super().__init__(message)
        self.reason = reason


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``90s``, ``1h30m`` or ``7d``; DurationError if it is not one.

    Units go largest first, each at most once. No bounds: each caller sets its own.
    """
    text = text.strip()
    if not text:
        raise DurationError("empty duration", "empty")
    pos = 0
    total = 0.0
    last_rank = -1
    for match in _DURATION_PART.finditer(text):
        if match.start() != pos:
            break
        rank = _DURATION_ORDER.index(match.group(2))
        if rank <= last_rank:
            raise DurationError(
                f"not a duration: {text!r} (units go from largest to smallest, each once; e.g. 1h30m)", "order"
            )
        last_rank = rank
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if pos != len(text):
        raise DurationError(
            f"not a duration: {text!r} (use a number and a unit: ms, s, m, h, d, w; e.g. 90s, 1h30m)", "syntax"
        )
    return total


def parse_size(text: str) -> int:
    """Bytes in a size such as ``16MiB``; ValueError if it is not one."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 512KiB, 16MiB, 1GB)")
    unit = (match.group(2) or "B").lower()
    return int(match.group(1)) * _SIZE_UNITS[unit]


def expand_env(raw: Any, path: str, problems: list[Problem], environ: Mapping[str, str] | None = None) -> Any:
    """Replace ``${env:VAR}`` in every string of a parsed document; a missing variable is a problem."""
    env = os.environ if environ is None else environ
    if isinstance(raw, str):
        if "$" not in raw:
            return raw

        def substitute(match: re.Match[str]) -> str:
            if match.group(0) == "$$":
                return "$"
            name, default = match.group(1), match.group(2)
            if name in env:
                return env[name]
            if default is not None:
                return default
            problems.append(Problem(path, f"environment variable {name} is not set"))
            return ""

        return _ENV_REF.sub(substitute, raw)
    if isinstance(raw, dict):
        return {k: expand_env(v, _join(path, str(k)), problems, env) for k, v in raw.items()}
    if isinstance(raw, list):
        return [expand_env(v, f"{path}[{i}]", problems, env) for i, v in enumerate(raw)]
    return raw


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


_MISSING = object()


def decode(cls: type[T], raw: Any, path: str, problems: list[Problem]) -> T:
    """Decode ``raw`` into dataclass ``cls``; problems are appended, defaults fill the gaps.

    Always returns an instance (with defaults where a value was bad), so that every
    section is checked even after an early error.
    """
    result = _decode_value(cls, raw, path, problems)
    if result is _MISSING:
        result = cls()
    return result  # type: ignore[no-any-return]


def _decode_dataclass(cls: type[Any], raw: Any, path: str, problems: list[Problem]) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(Problem(path or "(root)", f"must be a mapping, got {_type_name(raw)}"))
        try:
            return cls()
        except TypeError:
            return _MISSING  # it has required fields, so no default to fall back on (already reported)
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        key_path = _join(path, str(key))
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(Problem(key_path, f"unknown key{hint}; allowed: {', '.join(sorted(fields))}"))
            continue
        decoded = _decode_value(hints[key], value, key_path, problems)
        if decoded is not _MISSING:
            kwargs[key] = decoded
    for name, f in fields.items():
        if name not in kwargs and name not in raw and f.default is dataclasses.MISSING and (
            f.default_factory is dataclasses.MISSING
        ):
            problems.append(Problem(_join(path, name), "is required"))
    try:
        instance = cls(**kwargs)
    except TypeError:
        # A required field was missing (already reported): fall back to defaults where possible.
        return _MISSING
    validate = getattr(instance, "validate", None)
    if callable(validate):
        problems.extend(validate(path))
    return instance


def _decode_value(tp: Any, raw: Any, path: str, problems: list[Problem]) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _decode_dataclass(tp, raw, path, problems)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if raw is None and len(args) < len(get_args(tp)):
            return None
        if len(args) == 1:
            return _decode_value(args[0], raw, path, problems)
        for arg in args:
            trial: list[Problem] = []
            value = _decode_value(arg, raw, path, trial)
            if not trial:
                return value
        problems.append(Problem(path, f"has the wrong type ({_type_name(raw)})"))
        return _MISSING
    if origin is Literal:
        allowed = get_args(tp)
        if raw not in allowed:
            problems.append(Problem(path, f"must be one of {', '.join(repr(a) for a in allowed)}, got {raw!r}"
                                    if isinstance(raw, (str, int, bool)) or raw is None
                                    else f"must be one of {', '.join(repr(a) for a in allowed)}"))
            return _MISSING
        return raw
    if origin is list or origin is collections.abc.Sequence:
        (item_type,) = get_args(tp)
        if not isinstance(raw, list):
            problems.append(Problem(path, f"must be a list, got {_type_name(raw)}"))
            return _MISSING
        items = [_decode_value(item_type, v, f"{path}[{i}]", problems) for i, v in enumerate(raw)]
        return [v for v in items if v is not _MISSING]
    if origin is dict:
        _key_type, value_type = get_args(tp)
        if not isinstance(raw, dict):
            problems.append(Problem(path, f"must be a mapping, got {_type_name(raw)}"))
            return _MISSING
        out = {}
        for k, v in raw.items():
            decoded = _decode_value(value_type, v, _join(path, str(k)), problems)
            if decoded is not _MISSING:
                out[str(k)] = decoded
        return out
    if tp is Duration:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            seconds = float(raw)
        elif isinstance(raw, str):
            try:
                seconds = parse_duration(raw)
            except ValueError as exc:
                problems.append(Problem(path, str(exc)))
                return _MISSING
        else:
            problems.append(Problem(path, f"must be a duration such as 5s or 7d, got {_type_name(raw)}"))
            return _MISSING
        if not 0 <= seconds <= MAX_DURATION_S:  # also refuses nan and infinities
            problems.append(Problem(path, "must be a duration from 0 to 3660d"))
            return _MISSING
        return Duration(seconds)
    if tp is ByteSize:
        if isinstance(raw, int) and not isinstance(raw, bool):
            size = raw
        elif isinstance(raw, str):
            try:
                size = parse_size(raw)
            except ValueError as exc:
                problems.append(Problem(path, str(exc)))
                return _MISSING
        else:
            problems.append(Problem(path, f"must be a size such as 16MiB, got {_type_name(raw)}"))
            return _MISSING
        if size < 0:
            problems.append(Problem(path, "must not be negative"))
            return _MISSING
        return ByteSize(size)
    if tp is bool:
        if not isinstance(raw, bool):
            problems.append(Problem(path, f"must be true or false, got {_type_name(raw)}"))
            return _MISSING
        return raw
    if tp is int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            problems.append(Problem(path, f"must be an integer, got {_type_name(raw)}"))
            return _MISSING
        return raw
    if tp is float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            problems.append(Problem(path, f"must be a number, got {_type_name(raw)}"))
            return _MISSING
        if not math.isfinite(raw):
            problems.append(Problem(path, "must be a finite number"))
            return _MISSING
        return float(raw)
    if tp is str:
        if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
            problems.append(Problem(path, f"must be a string, got {_type_name(raw)}"))
            return _MISSING
        return str(raw)
    if tp is Any:
        return raw
    raise TypeError(f"configfmt cannot decode {tp!r} at {path}")  # a programming error, not a user's


def check_endpoint(value: str, path: str) -> list[Problem]:
    """``host:port`` with a port in range; the empty string means "off"."""
    if not value:
        return []
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        return [Problem(path, f"must be host:port, got {value!r}")]
    return []


def check_url(value: str, path: str) -> list[Problem]:
    """An http(s) URL; the empty string means "off"."""
    if not value:
        return []
    if not re.match(r"^https?://[^/\s]+", value):
        return [Problem(path, f"must be an http:// or https:// URL, got {value!r}")]
    return []


class _StrictConfigLoader(yaml.SafeLoader):
    """YAML for configuration: no aliases, no duplicate keys, booleans only as true/false.

    ``yes``/``no``/``on``/``off`` stay strings (then a type error names the path), so
    YAML 1.1's surprises never turn a value into a boolean behind the user's back.
    """


_StrictConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _no_duplicate_keys(loader: _StrictConfigLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _value in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            first = seen[key].start_mark
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice (first at line {first.line + 1})", key_node.start_mark
            )
        seen[key] = key_node
    return loader.construct_mapping(node, deep=True)


_StrictConfigLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicate_keys)


class YamlProblem(ValueError):
    """A configuration document that cannot be read, at ``where`` (``file:line:col``)."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where = where
        self.message = message


def load_yaml_strict(text: str, where: str) -> Any:
    """Parse a configuration document; raises YamlProblem naming ``where:line:col``."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_CONFIG_BYTES:
        raise YamlProblem(where, f"larger than {MAX_CONFIG_BYTES // 1024} KiB; a configuration is never that big")
    try:
        for event in yaml.parse(text, Loader=_StrictConfigLoader):
            if isinstance(event, yaml.AliasEvent):
                mark = event.start_mark
                place = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark is not None else where
                raise YamlProblem(place, "YAML aliases are not allowed in a configuration")
        return yaml.load(text, Loader=_StrictConfigLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        place = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark is not None else where
        raise YamlProblem(place, f"invalid YAML: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise YamlProblem(where, f"invalid YAML: {exc}") from None


def key_places(text: str, where: str) -> dict[str, str]:
    """``file:line:col`` of every key and list item of a configuration document, by config path.

    Paths are those the decoder names (``receivers.otlp.grpc.endpoint``, ``evaluate.rules[0]``).
    Only called once a document has problems: a valid configuration never pays for it.
    """
    places: dict[str, str] = {}

    def walk(node: yaml.Node, path: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = str(key_node.value)
                child = f"{path}.{key}" if path else key
                mark = key_node.start_mark
                places[child] = f"{where}:{mark.line + 1}:{mark.column + 1}"
                walk(value_node, child)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                child = f"{path}[{index}]"
                mark = item.start_mark
                places[child] = f"{where}:{mark.line + 1}:{mark.column + 1}"
                walk(item, child)

    try:
        root = yaml.compose(text, Loader=_StrictConfigLoader)
    except yaml.YAMLError:
        return places
    if root is not None:
        walk(root, "")
    return places


def placed(problems: list[Problem], places: dict[str, str]) -> list[Problem]:
    """The problems with ``at`` set from their config path, or the nearest enclosing key that is in the file."""
    out = []
    for problem in problems:
        path = problem.where
        while path and path not in places:
            cut = max(path.rfind("."), path.rfind("["))
            path = path[:cut] if cut > 0 else ""
        out.append(Problem(problem.where, problem.message, places[path]) if path else problem)
    return out
