"""The typed-YAML reader: YAML composed with its line marks, read into frozen dataclasses by type hint.

Every problem raises ConfigError reading ``<source>:<line>: <key.path>: <problem>; <fix>``.
A schema (plexus.config) is plain dataclasses: range checks in field metadata
(``metadata={"check": fn}``, fn(value) -> "<problem>; <fix>" or None), cross-field checks,
pre-read and post-read steps in the mappings passed to `parse`/`load`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from plexus.errors import ConfigError

__all__ = ["MAX_ITEMS", "PLAIN_EXP_FLOAT", "Cell", "Reader", "in_range", "load", "matching", "non_empty", "one_of",
           "parse", "parse_value"]

# A cross-field check: fn(obj) -> (key, "<problem>; <fix>") or None; the key may also be a path below the
# mapping ("statistics.columns[1]"), where the error then points. A post-read step:
# fn(reader, obj, entries, path) -> obj, for a value whose reading depends on its siblings. A pre-read step:
# fn(reader, node, path) -> node, for keys derived from others before the mapping is read (a required key
# that another key implies).
CrossCheck = Callable[[Any], "tuple[str, str] | None"]
AfterRead = Callable[["Reader", Any, "dict[str, tuple[Node, Node]]", str], Any]
BeforeRead = Callable[["Reader", Node, str], Node]


class Cell(str):
    """Marks a field that holds a CSV cell's text: YAML's `0`, `yes` and `1.5` read as "0", "yes", "1.5"."""


def in_range(lo: float, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False) -> dict:
    """Field metadata: the value lies in [lo, hi] (open ends as asked; hi None: no upper bound)."""
    if hi is None:
        wanted = f"> {lo}" if lo_open else f">= {lo}"
    else:
        wanted = f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"

    def check(value: float) -> str | None:
        too_low = value <= lo if lo_open else value < lo
        too_high = hi is not None and (value >= hi if hi_open else value > hi)
        return f"{value!r} is out of range; use a value {wanted}" if too_low or too_high else None

    return {"check": check}


def one_of(*choices: str) -> dict:
    """Field metadata: the value is one of `choices`."""
    def check(value: str) -> str | None:
        if value in choices:
            return None
        return f"{value!r} is not allowed; use one of: {', '.join(sorted(choices))}"

    return {"check": check}


def matching(pattern: str, rule: str) -> dict:
    """Field metadata: the value matches `pattern` whole; `rule` says it in words."""
    regex = re.compile(pattern)

    def check(value: str) -> str | None:
        return None if regex.fullmatch(value) else f"{value!r} is not a valid name; use {rule}"

    return {"check": check}


def non_empty() -> dict:
    """Field metadata: the list or mapping has at least one item."""
    return {"check": lambda value: None if value else "is empty; list at least one item or remove the key"}


_TAG = "tag:yaml.org,2002:"
_TAG_NAMES = {"bool": "a boolean", "int": "an integer", "float": "a number", "null": "null",
              "str": "a string", "timestamp": "a date"}
_SCALARS = {  # type -> (accepted YAML tags, name, fix)
    bool: ({"bool"}, "a boolean", "write true or false"),
    int: ({"int"}, "an integer", "write a whole number, e.g. 3"),
    float: ({"int", "float"}, "a number", "write a number, e.g. 0.5"),
    str: ({"str"}, "a string", "write a string (quote it if it looks like a number, date or boolean)"),
    Path: ({"str"}, "a path", "write a file path"),
    Cell: ({"str", "int", "float", "bool"}, "a value", "write the value as it appears in the CSV file"),
}
# PyYAML (YAML 1.1) reads an unquoted 1e-5 as a string; a float field accepts it anyway.
PLAIN_EXP_FLOAT = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+")
_CONSTRUCTOR = yaml.constructor.SafeConstructor()
# Plain scalars YAML 1.1 reads as numbers in bases other than ten, or in base 60.
YAML11_ONLY = re.compile(r"[-+]?(?:0b[01_]+|0x[0-9a-fA-F_]+|0[0-7_]+|[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?)")
MAX_INT = 2**63 - 1   # what SQLite and int64 hold
MAX_ITEMS = 4096   # entries of any one list or mapping (features, classes, categories, ...)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


_STEP = re.compile(r"([^.\[\]]+)|\[(\d+)\]")   # a key, or a list index: statistics.columns[1]


def _node_at(node: Node, key: str) -> Node:
    """The node a cross-check's key names below `node` (a key, or a path of keys and indexes), or the deepest
    one of its path that is written (a key left at its default is not)."""
    for name, index in _STEP.findall(key):
        if name and isinstance(node, MappingNode):
            found = [v for k, v in node.value if isinstance(k, ScalarNode) and k.value == name]
        elif index and isinstance(node, SequenceNode):
            found = node.value[int(index):int(index) + 1]
        else:
            found = []
        if not found:
            break
        node = found[-1]
    return node


def _describe(node: Node) -> str:
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    name = _TAG_NAMES.get(node.tag.removeprefix(_TAG), f"a value tagged {node.tag}")
    return name if name == "null" else f"{name} ({node.value})"


def _expected(tp: Any) -> str:
    if dataclasses.is_dataclass(tp) or tp is dict or typing.get_origin(tp) is dict:
        return "a mapping"
    if typing.get_origin(tp) is tuple:
        return "a list"
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        return _expected(_optional_inner(tp))
    return _SCALARS[tp][1]


def _short(text: str, keep: int = 24) -> str:
    return text if len(text) <= keep else f"{text[:keep]}... ({len(text)} characters)"


def _optional_inner(tp: Any) -> Any:
    (inner,) = [arg for arg in typing.get_args(tp) if arg is not type(None)]
    return inner


def _is_null(node: Node) -> bool:
    return isinstance(node, ScalarNode) and node.tag == _TAG + "null"


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)



class Reader:
    """Reads a composed YAML node tree into the type a dataclass field declares.

    `checks`, `after` and `before` map a dataclass to its cross-field check, post-read and pre-read step.
    `arguments_of` (e.g. "strategy 'fedprox'") words the keys of the dataclass read at the top
    as that thing's arguments, and reads a quoted exponent number ('1e-3') as a number, as
    free-form argument values always were.
    """

    def __init__(self, source: str, base: Path | None = None, *, checks: Mapping[type, CrossCheck] | None = None,
                 after: Mapping[type, AfterRead] | None = None, arguments_of: str = "",
                 before: Mapping[type, BeforeRead] | None = None) -> None:
        self.source = source
        self.base = base
        self.checks = checks or {}
        self.after = after or {}
        self.before = before or {}
        self.arguments_of = arguments_of
        self._seen: set[int] = set()

    def fail(self, node: Node, path: str, problem: str) -> NoReturn:
        raise ConfigError(f"{self.source}:{node.start_mark.line + 1}: {path or '(top level)'}: {problem}")

    def read(self, tp: Any, node: Node, path: str) -> Any:
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            return self.read_dataclass(tp, node, path)
        if origin in (types.UnionType, typing.Union):  # only `X | None` is used
            return None if _is_null(node) else self.read(_optional_inner(tp), node, path)
        if origin is tuple:
            return tuple(self.read(args[0], item, f"{path}[{i}]")
                         for i, item in enumerate(self.items(node, path)))
        if origin is dict:
            return {key: self.read(args[1], value, _join(path, key))
                    for key, (_, value) in self.entries(node, path).items()}
        if tp is dict:
            return {key: self.plain(value, _join(path, key))
                    for key, (_, value) in self.entries(node, path).items()}
        return self.scalar(tp, node, path)

    def read_dataclass(self, cls: type, node: Node, path: str) -> Any:
        if cls in self.before:
            node = self.before[cls](self, node, path)
        fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("derived")}
        allowed = ", ".join(sorted(fields))
        entries = self.entries(node, path, fix=f"write a mapping with keys: {allowed}")
        for key, (key_node, _) in entries.items():
            if key not in fields:
                close = difflib.get_close_matches(key, fields, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                problem = f"unknown key; allowed keys: {allowed}{hint}"
                if self.arguments_of:
                    fix = f"accepted arguments: {allowed}{hint}" if fields else "remove it"
                    problem = f"unknown argument for {self.arguments_of}; {fix}"
                self.fail(key_node, _join(path, key), problem)
        hints, values = _hints(cls), {}
        for name, f in fields.items():
            if name in entries:
                value_node = entries[name][1]
                values[name] = self.read(hints[name], value_node, _join(path, name))
                check = f.metadata.get("check")
                problem = check(values[name]) if check and values[name] is not None else None
                if problem:
                    self.fail(value_node, _join(path, name), problem)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                problem = f"missing required key; add '{name}:' with {_expected(hints[name])}"
                if self.arguments_of:
                    problem = (f"required by {self.arguments_of} but not set; "
                               f"add '{name}:' with {_expected(hints[name])}")
                self.fail(node, _join(path, name), problem)
            elif isinstance(f.default, Path):
                values[name] = self.path(f.default)
        obj = cls(**values)
        problem = self.checks[cls](obj) if cls in self.checks else None
        if problem:
            key, text = problem
            self.fail(_node_at(node, key), _join(path, key), text)
        return self.after[cls](self, obj, entries, path) if cls in self.after else obj

    def entries(
        self, node: Node, path: str, fix: str = "write key: value pairs"
    ) -> dict[str, tuple[Node, Node]]:
        """The mapping's string keys to (key node, value node); rejects duplicates."""
        if not isinstance(node, MappingNode):
            self.fail(node, path, f"expected a mapping, got {_describe(node)}; {fix}")
        self.once(node, path)
        self.count(node, path, "keys")
        entries: dict[str, tuple[Node, Node]] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _TAG + "merge":
                self.fail(key_node, path, "merge keys (<<) are not supported; write the keys out")
            if not (isinstance(key_node, ScalarNode) and key_node.tag == _TAG + "str"):
                self.fail(key_node, path, f"keys must be strings, got {_describe(key_node)}; quote the key")
            key = key_node.value
            if key in entries:
                first = entries[key][0].start_mark.line + 1
                self.fail(key_node, _join(path, key), f"duplicate key (first at line {first}); keep only one")
            entries[key] = (key_node, value_node)
        return entries

    def items(self, node: Node, path: str) -> list[Node]:
        if not isinstance(node, SequenceNode):
            self.fail(node, path, f"expected a list, got {_describe(node)}; write a list, e.g. [a, b]")
        self.once(node, path)
        self.count(node, path, "items")
        return node.value

    def count(self, node: Node, path: str, what: str) -> None:
        if len(node.value) > MAX_ITEMS:
            self.fail(node, path, f"has {len(node.value)} {what}; at most {MAX_ITEMS} are allowed, so list fewer")

    def once(self, node: Node, path: str) -> None:
        # An alias re-uses its anchor's node: refusing repeats stops recursive
        # documents and exponential "billion laughs" expansion in submitted configs.
        if id(node) in self._seen:
            self.fail(node, path,
                      "repeats a mapping or list through a YAML alias; write the value out in full")
        self._seen.add(id(node))

    def scalar(self, tp: type, node: Node, path: str) -> Any:
        tags, name, fix = _SCALARS[tp]
        tag = node.tag.removeprefix(_TAG) if isinstance(node, ScalarNode) else None
        if tag in tags:
            if tp in (int, float):
                self.decimal(node, path)
            try:
                value = _CONSTRUCTOR.yaml_constructors[node.tag](_CONSTRUCTOR, node)
            except ValueError:
                self.fail(node, path, f"{node.value!r} is not {name}; {fix}")
        elif tp is float and tag == "str" and (node.style is None or self.arguments_of) \
                and PLAIN_EXP_FLOAT.fullmatch(node.value):
            value = node.value
        else:
            self.fail(node, path, f"expected {name}, got {_describe(node)}; {fix}")
        if tp is Cell:
            value = node.value   # the text as written: `007` stays "007", `yes` stays "yes"
        if tp is int and abs(value) > MAX_INT:
            self.fail(node, path, f"{_short(node.value)} is out of range; integers are at most {MAX_INT}")
        if tp is float:
            try:
                value = float(value)
            except OverflowError:
                self.fail(node, path, f"{_short(node.value)} is too large for a number; {fix}")
            if not math.isfinite(value):
                self.fail(node, path, f"{value!r} is not a finite number; {fix}")
        if tp in (str, Path, Cell) and not value:
            self.fail(node, path, f"is empty; {fix}")
        return self.path(value) if tp is Path else value

    def plain(self, node: Node, path: str) -> Any:
        """A free-form value (model args): strings, numbers, booleans, null, lists, mappings."""
        if isinstance(node, MappingNode):
            return self.read(dict, node, path)
        if isinstance(node, SequenceNode):
            return [self.plain(item, f"{path}[{i}]") for i, item in enumerate(self.items(node, path))]
        if node.tag.removeprefix(_TAG) not in ("str", "int", "float", "bool", "null"):
            self.fail(node, path, f"unsupported value, {_describe(node)}; "
                                  "use a string, number, boolean, list or mapping (quote dates)")
        self.decimal(node, path)
        return _CONSTRUCTOR.yaml_constructors[node.tag](_CONSTRUCTOR, node)

    def decimal(self, node: Node, path: str) -> None:
        """Refuse the number forms only YAML 1.1 has (1:30 is 90, 010 is 8, 0x10 is 16): a config means them
        as written, if at all."""
        if node.tag in (_TAG + "int", _TAG + "float") and YAML11_ONLY.fullmatch(node.value):
            digits = node.value.lstrip("+-")
            kind = ("a base-60" if ":" in digits else "a binary" if digits.startswith("0b")
                    else "a hexadecimal" if digits.startswith("0x") else "an octal")
            self.fail(node, path, f"{node.value} is {kind} number in YAML 1.1; write it in decimal (or quote it, "
                                  "for a string)")

    def path(self, value: str | Path) -> Path:
        path = Path(value).expanduser()
        return self.base / path if self.base is not None and not path.is_absolute() else path


def parse(text: str, cls: type, *, source: str, base: Path | None = None, max_bytes: int,
          checks: Mapping[type, CrossCheck] | None = None, after: Mapping[type, AfterRead] | None = None,
          before: Mapping[type, BeforeRead] | None = None) -> Any:
    """`cls` read from YAML text of at most `max_bytes`; `source` labels error messages."""
    keys = ", ".join(sorted(f.name for f in dataclasses.fields(cls) if not f.metadata.get("derived")))
    check_size(len(text.encode("utf-8", "replace")), max_bytes, source)
    root = compose(text, source)
    if root is None or _is_null(root):
        raise ConfigError(f"{source}:1: (top level): the document is empty; "
                          f"write a mapping with keys: {keys}")
    try:
        return Reader(source, base, checks=checks, after=after, before=before).read(cls, root, "")
    except RecursionError:
        raise ConfigError(f"{source}:1: (top level): nested too deeply; flatten the document") from None


def compose(text: str, source: str) -> Node | None:
    """The YAML node tree of `text` (line marks kept), or None for an empty document."""
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        problem = ", ".join(part for part in (e.context, e.problem) if part)
        raise ConfigError(f"{source}:{mark.line + 1 if mark else 1}: (yaml): {problem}; "
                          "fix the YAML syntax") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}:1: (yaml): {e}; fix the YAML syntax") from None
    except RecursionError:
        raise ConfigError(f"{source}:1: (yaml): nested too deeply; flatten the document") from None


def parse_value(value: Any, cls: type, *, source: str, path: str, arguments_of: str = "") -> Any:
    """`cls` read from an already-parsed plain value (a mapping built in code), by the same rules."""
    node = compose(yaml.safe_dump(value), source)
    return Reader(source, arguments_of=arguments_of).read(cls, node if node is not None else empty_mapping(), path)


def empty_mapping(at: Node | None = None) -> MappingNode:
    """An empty mapping node, marked at `at` (where a missing key's errors then point)."""
    return MappingNode(tag=_TAG + "map", value=[], start_mark=at.start_mark if at is not None else _NO_MARK,
                       end_mark=at.end_mark if at is not None else _NO_MARK)


_NO_MARK = yaml.Mark("", 0, 0, 0, None, None)


def check_size(size: int, max_bytes: int, source: str) -> None:
    """ConfigError for a config over `max_bytes`, checked before it is read."""
    if size > max_bytes:
        raise ConfigError(f"{source}: the config is {size} bytes, over the limit of {max_bytes} bytes "
                          f"({max_bytes >> 10} KiB) that is read at all; shorten it (fewer or shorter lists)")


def load(path: Path, cls: type, *, max_bytes: int, checks: Mapping[type, CrossCheck] | None = None,
         after: Mapping[type, AfterRead] | None = None, before: Mapping[type, BeforeRead] | None = None) -> Any:
    """`cls` read from a UTF-8 YAML file; relative paths in it resolve against its folder."""
    path = Path(path)
    try:
        check_size(path.stat().st_size, max_bytes, str(path))   # before reading a file of any size
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file ({e.strerror or e}); check the path") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: config file is not UTF-8 text; save it as UTF-8") from None
    return parse(text, cls, source=str(path), base=Path(os.path.abspath(path)).parent, max_bytes=max_bytes,
                 checks=checks, after=after, before=before)
