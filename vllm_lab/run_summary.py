"""One run's summary as one typed record, generated from the one catalog: a ``float | None``
attribute for every figure of ``summary.METRICS`` and a typed one for every fact of
``summary.FACTS``, each described by its catalog entry (``RunSummary.describe``).

Code reads and sets attributes (``summary.goodput``, ``summary.meets_slo = ...``): a misspelled
name is an AttributeError, not a silent None. A loop over catalog names reads ``figure(name)``.
Keys a store holds beyond the catalog (an older lab's, a newer one's) are kept in ``extra`` and
written back as they were, so every store written before still opens and its reports rebuild.
The record also reads as a mapping of its set entries (``summary["goodput"]``, ``**summary``),
the shape a run's summary had in the store and in earlier code.

``summary.summarize`` computes the figures; backends turn them into a ``RunSummary`` where a run
ends, and the store keeps its ``record()``: the catalog's columns as columns, the rest as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Mapping
from typing import Any

from vllm_lab.summary import CATALOG, COLUMNS, FACTS, METRICS, metric


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python number it holds (JSON and SQLite take those)."""
    return value.item() if hasattr(value, "item") and not isinstance(value, (list, dict, str)) else value


class _Record(Mapping):
    """The reading side every RunSummary shares: by attribute, by catalog name, or as a mapping."""

    __slots__ = ()

    @classmethod
    def of(cls, values: Mapping[str, Any] | RunSummary | str | None = None, **more: Any) -> RunSummary:
        """A summary from a mapping of its entries (or its JSON, or a summary), with ``more`` over
        them; keys outside the catalog are kept in ``extra``."""
        if isinstance(values, RunSummary):
            values = values.record()
        elif isinstance(values, str):
            values = json.loads(values) if values else {}
        out = cls()
        out.update(values or {}, **more)
        return out

    @classmethod
    def of_row(cls, row: Mapping[str, Any]) -> RunSummary:
        """The whole summary of a stored run: its summary JSON and the store's figure columns."""
        columns = {c: row[c] for c in COLUMNS if c in row and _present(row[c])}
        return cls.of(row.get("summary") or row.get("summary_json"), **columns)

    def update(self, values: Mapping[str, Any] | None = None, **more: Any) -> None:
        """Set entries by name (catalog names as attributes, any other kept in ``extra``)."""
        for name, value in {**(values or {}), **more}.items():
            if name in FIELDS:
                setattr(self, name, _plain(value))
            else:
                self.extra[name] = value

    def figure(self, name: str) -> float | None:
        """A catalog figure by name (KeyError for a name the catalog does not know)."""
        value = getattr(self, metric(name).name)
        return None if value is None else float(value)

    def record(self) -> dict[str, Any]:
        """The summary as the store keeps it: its set entries, then the keys it was given beyond
        the catalog, as they were."""
        out = {f: getattr(self, f) for f in FIELDS if getattr(self, f) is not None}
        return {**out, **self.extra}

    @staticmethod
    def describe(name: str) -> str:
        """What an entry is, from the catalog."""
        if name in CATALOG:
            m = CATALOG[name]
            return f"{m.label} ({m.unit})"
        return next(f.label for f in FACTS if f.name == name)

    # -- a mapping of the set entries -----------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        value = getattr(self, name, None) if name in FIELDS else self.extra.get(name)
        if value is None and name not in self.extra:
            raise KeyError(name)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self.record())

    def __len__(self) -> int:
        return len(self.record())

    def __eq__(self, other: object) -> bool:
        """Equal to a summary or a mapping with the same entries."""
        if not isinstance(other, Mapping):
            return NotImplemented
        return self.record() == dict(other.items())

    __hash__ = None  # a mutable record


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


# Every entry of the catalog, in its order: figures, then facts.
FIELDS: tuple[str, ...] = tuple(m.name for m in METRICS) + tuple(f.name for f in FACTS)

RunSummary = dataclasses.make_dataclass(
    "RunSummary",
    [(m.name, float | None, dataclasses.field(default=None, metadata={"entry": m})) for m in METRICS]
    + [(f.name, f.kind | None, dataclasses.field(default=None, metadata={"entry": f})) for f in FACTS]
    + [("extra", dict[str, Any], dataclasses.field(default_factory=dict))],
    bases=(_Record,), slots=True, eq=False, repr=False,
    namespace={"__doc__": "One run's summary: every figure and fact of the catalog (None until "
                          "set), and the keys a store holds beyond it (``extra``).",
               "__repr__": lambda self: f"RunSummary({self.record()!r})",
               "__module__": __name__})
