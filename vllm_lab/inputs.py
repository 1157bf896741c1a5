"""What a user hands the lab, taken within bounds: files of a known size only, UTF-8 text, YAML and
JSON that cannot multiply themselves, and values shown back in an error cut to a readable length.

A scenario may come from anywhere (``SCENARIO=/dev/zero``, a FIFO, a file of gigabytes, nine nested
levels of YAML aliases that expand to a billion values): each is refused with one sentence before
it can take the machine's memory or hang the command.
"""

from __future__ import annotations

import copy
import json
import os
import stat
from pathlib import Path
from typing import Any

import yaml

from vllm_lab.flags import REDACTED, is_secret, redact

MIB = 1024 * 1024
# Configuration files (scenarios, presets, spaces, profiles, inventories): far above any real one.
CONFIG_BYTES = 4 * MIB
# Request files (ShareGPT's own is 0.7 GB), traces, a model's config.json.
DATA_BYTES = 2048 * MIB
# Values a YAML or JSON document may hold once every alias is expanded, and how deep it may nest.
MAX_VALUES = 200_000
MAX_DEPTH = 64
# Characters of a value an error sentence shows.
SHOWN_CHARS = 80


class InputError(ValueError):
    """A file or value the lab will not take; the message is one sentence naming it."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "device"),
                       (stat.S_ISBLK, "device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def read_bytes(path: Path | str, limit: int = CONFIG_BYTES, what: str = "file") -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them; InputError otherwise."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just below).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InputError(f"{path}: no such {what}") from None
    except OSError as e:
        raise InputError(f"{path}: the {what} cannot be read ({e.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InputError(f"{path}: a {_kind(info.st_mode)}; the {what} must be a regular file")
        if info.st_size > limit:
            raise InputError(f"{path}: {info.st_size / MIB:.1f} MiB; the {what} may hold at most "
                             f"{limit / MIB:.0f} MiB")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(MIB, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise InputError(f"{path}: the {what} cannot be read ({e.strerror})") from None
    finally:
        os.close(fd)
    if size > limit:  # it grew while being read
        raise InputError(f"{path}: grew while being read; the {what} may hold at most "
                         f"{limit / MIB:.0f} MiB")
    return b"".join(chunks)


def read_text(path: Path | str, limit: int = CONFIG_BYTES, what: str = "file") -> str:
    """The UTF-8 text of the regular file ``path``, at most ``limit`` bytes; InputError otherwise."""
    data = read_bytes(path, limit, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise InputError(f"{path} line {line}: not UTF-8 text (byte {data[e.start]:#04x}); save "
                         f"the {what} as UTF-8") from None


def bounded(data: Any, where: str, limit: int = MAX_VALUES, depth: int = MAX_DEPTH) -> Any:
    """``data`` once its expanded size (every alias counted as often as it is used) is at most
    ``limit`` values, ``depth`` levels deep, with no value inside itself; else InputError."""
    sizes: dict[int, int] = {}
    path: set[int] = set()

    def size(node: Any, level: int) -> int:
        if not isinstance(node, (dict, list, tuple, set)):
            return 1
        key = id(node)
        if key in path:
            raise InputError(f"{where}: an alias refers to the value it is in (an endless value)")
        if key in sizes:
            return sizes[key]
        if level > depth:
            raise InputError(f"{where}: nested more than {depth} levels deep")
        path.add(key)
        items = [x for kv in node.items() for x in kv] if isinstance(node, dict) else node
        total = 1
        for item in items:
            total += size(item, level + 1)
            if total > limit:
                raise InputError(f"{where}: more than {limit:,} values once its aliases are "
                                 f"expanded; write the values out, without alias upon alias")
        path.discard(key)
        sizes[key] = total
        return total

    size(data, 0)
    return data


# An integer's decimal digits Python will print (sys.get_int_max_str_digits): a longer one could be
# read (in binary, or base 60) but never shown or stored.
MAX_INT_DIGITS = 4300
_MAX_INT_BITS = int(MAX_INT_DIGITS * 3.3219)  # log2(10) bits per digit, rounded down


def _constructor_problem(error: Exception) -> str:
    """What a PyYAML constructor's own exception says, without the value (which may be a secret)."""
    text = str(error)
    if "integer string conversion" in text:
        return f"an integer of more than {MAX_INT_DIGITS:,} digits"
    if isinstance(error, (ValueError, OverflowError)) and text:
        return text.split(":", 1)[0]
    return "not a value of its type"


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader whose constructors' own errors (a date 2001-13-45, ``!!float abc``, an
    integer past Python's digit limit) are InputError naming the line, never ValueError & co."""

    where = ""
    lines = True

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        """PyYAML's hook for each node: its value, or InputError naming its line and tag."""
        try:
            value = super().construct_object(node, deep)
        except (InputError, yaml.YAMLError, RecursionError):
            raise
        except (ValueError, OverflowError, TypeError, IndexError, AttributeError, KeyError) as e:
            raise InputError(self._sentence(node, _constructor_problem(e))) from None
        if isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
            raise InputError(self._sentence(node, f"an integer of more than {MAX_INT_DIGITS:,} "
                                                  f"digits"))
        return value

    def _sentence(self, node: yaml.Node, problem: str) -> str:
        line = f" line {node.start_mark.line + 1}" if self.lines else ""
        kind = str(node.tag).rsplit(":", 1)[-1]
        return (f"{self.where}{line}: cannot be read as {kind} ({problem}); write a valid {kind}, "
                f"or quote the value to keep it as text")


# The same few files (hardware presets, twin profiles, scenarios) are read again for every point a
# plan resolves and every prediction it makes, and PyYAML's pure-Python parser is slow: a small
# document read before is handed out again, as a copy of its data.
_PARSED: dict[tuple[str, str, bool], Any] = {}
_PARSED_MAX_CHARS = 1 << 16


def load_yaml(text: str, where: str, lines: bool = True) -> Any:
    """YAML ``text`` (from ``where``) as data, bounded like ``bounded``; yaml.YAMLError as PyYAML
    raises it for broken YAML, InputError for a value its tag cannot take (naming the line) and
    for a document that nests or expands past the bounds (``lines``: whether a sentence names the
    line, not for a one-line value such as an override's)."""
    key = (text, where, lines)
    known = _PARSED.get(key, _PARSED)
    if known is not _PARSED:
        return copy.deepcopy(known)
    data = _load_yaml(text, where, lines)
    if len(text) <= _PARSED_MAX_CHARS:
        if len(_PARSED) >= 256:
            _PARSED.clear()
        _PARSED[key] = copy.deepcopy(data)
    return data


def _load_yaml(text: str, where: str, lines: bool) -> Any:
    loader = _Loader(text)
    loader.where, loader.lines = where, lines
    try:
        data = loader.get_single_data()
    except RecursionError:
        raise InputError(f"{where}: nested too deeply to read") from None
    finally:
        loader.dispose()
    return bounded(data, where)


def load_json(text: str | bytes, where: str) -> Any:
    """JSON ``text`` (from ``where``) as data, bounded in depth; ValueError as json raises it."""
    try:
        return json.loads(text)
    except RecursionError:
        raise InputError(f"{where}: nested too deeply to read") from None


def shown(value: Any, key: str = "", chars: int = SHOWN_CHARS) -> str:
    """``value`` as an error sentence shows it: ``***`` for a secret (by its key, whatever its type),
    else its repr with every secret inside it redacted (``flags.redact``: by each nested key, a
    URL's userinfo), cut to ``chars`` characters."""
    if key and is_secret(str(key).rsplit(".", 1)[-1]):
        return REDACTED
    try:
        text = repr(redact(value))
    except (RecursionError, ValueError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= chars else f"{text[:chars - 1]}…"
