"""What a user hands the lab, taken within bounds: files of a known size only, UTF-8 text, YAML and
JSON that cannot multiply themselves, and values shown back in an error cut to a readable length.

A scenario may come from anywhere (``SCENARIO=/dev/zero``, a FIFO, a file of gigabytes, nine nested
levels of YAML aliases that expand to a billion values): each is refused with one sentence before
it can take the machine's memory or hang the command.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import yaml

from vllm_lab.flags import REDACTED, is_secret

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


def load_yaml(text: str, where: str) -> Any:
    """YAML ``text`` (from ``where``) as data, bounded like ``bounded``; yaml.YAMLError as PyYAML
    raises it, InputError for a document that nests or expands past the bounds."""
    try:
        data = yaml.safe_load(text)
    except RecursionError:
        raise InputError(f"{where}: nested too deeply to read") from None
    return bounded(data, where)


def load_json(text: str | bytes, where: str) -> Any:
    """JSON ``text`` (from ``where``) as data, bounded in depth; ValueError as json raises it."""
    try:
        return json.loads(text)
    except RecursionError:
        raise InputError(f"{where}: nested too deeply to read") from None


def shown(value: Any, key: str = "", chars: int = SHOWN_CHARS) -> str:
    """``value`` as an error sentence shows it: ``***`` for a secret (by its key, whatever its type),
    else its repr, cut to ``chars`` characters."""
    if key and is_secret(str(key).rsplit(".", 1)[-1]):
        return REDACTED
    try:
        text = repr(value)
    except (RecursionError, ValueError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= chars else f"{text[:chars - 1]}…"
