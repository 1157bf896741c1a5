"""The results store: one SQLite database (WAL) and one Parquet file of raw request samples per run.

Schema (version 4; ``SCHEMA`` below is the documentation):

- ``meta``: key/value; ``schema_version`` says which lab wrote the file.
- ``experiments``: one row per experiment (a baseline, a sweep, a combination, a stress test ...).
- ``runs``: one row per measured run, written once when the run ends, in one transaction; its
  ``run_key`` is a hash of the resolved scenario and the repeat index, so a resumed experiment
  skips what it already has.
- ``server_metrics``: the server's /metrics and GPU telemetry scraped during a run, long format.
- raw samples: ``<db stem>.samples/<experiment id>/<run key>.parquet``, one row per request.

A database written by a newer schema is refused, never altered. An older one is migrated in place:
version 1 called a run whose client could not keep up ``client-overloaded``; version 2 calls it
``client-limited`` and keeps it out of every comparison; version 3 adds ``failed-requests`` (too
many of the run's requests failed: it measured nothing) and ``unreachable`` (no host answered:
retried on resume, like a crash), a rebuild of the runs table, whose CHECK SQLite cannot alter;
version 4 adds ``unsteady`` (the run did not hold its load: its steady window covered a small part
of it, or it drained far longer than a request takes) and ``unaudited`` (a live run without vLLM's
own account of it), by the same rebuild. Every older store opens and its runs keep their status.
A run's ``backend`` is ``vllm`` or ``twin`` (a server the lab started), ``predict`` (the twin's
offline predictor) or ``live`` (a deployment the regression watch probes but did not start). A run on
real vLLM also keeps, in ``summary_json[PREDICTION_KEY]``, what the twin predicted for its scenario
when it was measured, so a report compares the two without running the twin again.
Secrets (``flags.is_secret``) are redacted from every scenario and experiment before they are
written.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Self

import pandas as pd

from vllm_lab import outdir
from vllm_lab.flags import redact
from vllm_lab.inputs import DATA_BYTES, read_bytes
from vllm_lab.run_summary import RunSummary
from vllm_lab.summary import COLUMNS, as_float

SCHEMA_VERSION = 5
DEFAULT_PATH = Path("reports/lab.db")
STEPS = ("baseline", "sweep", "combo", "tune", "stress", "monitor", "watch", "claims", "calibrate",
         "autotune")


class RunStatus(StrEnum):
    """How a run ended: ``ok``, or why it measured nothing of the server (a string in the store)."""

    OK = "ok"
    FAILED_START = "failed-start"   # vLLM refused its flags, or the lab refused them before launch
    OOM = "oom"
    CRASHED = "crashed"
    TIMEOUT = "timeout"             # the server did not answer /health in time
    CLIENT_LIMITED = "client-limited"
    FAILED_REQUESTS = "failed-requests"
    UNREACHABLE = "unreachable"     # no host answered
    UNSTEADY = "unsteady"           # the load did not hold: a short window or a long drain
    UNAUDITED = "unaudited"         # a live run vLLM's /metrics gave no account of
    LOADGEN_FAILED = "loadgen-failed"  # the load generator failed: nothing of the server measured


STATUSES = tuple(RunStatus)
# Runs that ended but measured the client, nothing, or not the load asked for: recorded with their
# figures and reason, and, like every status but ok, left out of best points, verdicts, knees and
# fits.
LEFT_OUT = (RunStatus.CLIENT_LIMITED, RunStatus.FAILED_REQUESTS, RunStatus.UNSTEADY,
            RunStatus.UNAUDITED)
RETRIED_ON_RESUME = (RunStatus.CRASHED, RunStatus.TIMEOUT, RunStatus.UNREACHABLE,
                     RunStatus.LOADGEN_FAILED)
# Backends whose repeats read the same figures (the predictor, from one seed): a figure of theirs
# has no run-to-run noise, and nothing is judged against a noise they do not have.
DETERMINISTIC_BACKENDS = ("predict",)
# How long a writer waits for another process's transaction before it gives up with a sentence.
LOCK_TIMEOUT_S = 30.0

# The one pattern of experiment names: every path the lab derives from one (reports, samples, work
# folders) is a single folder name inside OUT, never a separator, never "..", never hidden.
EXPERIMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
EXPERIMENT_NAME_RULE = ("1-128 letters, digits, '.', '_' or '-', starting with a letter or digit, "
                        "without '..'")
# Tables an Optuna study adds beside the lab's in the same database (make tune).
_OPTUNA_TABLES = {"studies", "study_directions", "study_user_attributes", "study_system_attributes",
                  "trials", "trial_user_attributes", "trial_system_attributes", "trial_params",
                  "trial_values", "trial_intermediate_values", "trial_heartbeats", "version_info",
                  "alembic_version"}

# The summary metrics every run row carries as columns (seconds, per second, counts), from the one
# catalog (summary.METRICS); anything else a plan computes goes into summary_json.
SUMMARY_COLUMNS = COLUMNS
# The key of summary_json under which a run on real vLLM keeps the twin's prediction of the same
# scenario, made when the run was measured (backends.twin_prediction): reports read it from here.
PREDICTION_KEY = "twin_prediction"

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS experiments (
    id TEXT PRIMARY KEY,              -- the experiment's name, e.g. sweep-max-num-seqs-20261130-0201
    step TEXT NOT NULL,               -- {' | '.join(STEPS)}
    scenario_name TEXT NOT NULL,
    created REAL NOT NULL,            -- unix seconds
    meta_json TEXT NOT NULL DEFAULT '{{}}'  -- plan parameters: swept flag, values, hosts, ...
);
CREATE TABLE IF NOT EXISTS runs (
    experiment_id TEXT NOT NULL REFERENCES experiments(id),
    run_key TEXT NOT NULL,            -- hash of the resolved scenario and the repeat index
    step TEXT NOT NULL,
    scenario_name TEXT NOT NULL,
    scenario_json TEXT NOT NULL,      -- the resolved scenario, exactly as it ran
    point_json TEXT NOT NULL DEFAULT '{{}}',  -- the values this run varies, e.g. {{"max-num-seqs": 64}}
    repeat INTEGER NOT NULL DEFAULT 0,
    host TEXT NOT NULL DEFAULT '',
    gpu_model TEXT NOT NULL DEFAULT '',
    gpu_count INTEGER NOT NULL DEFAULT 0,
    vllm_version TEXT NOT NULL DEFAULT '',
    backend TEXT NOT NULL DEFAULT '',  -- vllm | twin | predict | live (a watched deployment the lab did not start)
    status TEXT NOT NULL CHECK (status IN ({', '.join(repr(s.value) for s in STATUSES)})),
    error TEXT NOT NULL DEFAULT '',
    started REAL NOT NULL,
    ended REAL NOT NULL,
    {', '.join(f'{c} REAL' for c in SUMMARY_COLUMNS)},
    summary_json TEXT NOT NULL DEFAULT '{{}}',
    samples_file TEXT NOT NULL DEFAULT '',   -- relative to the samples folder
    PRIMARY KEY (experiment_id, run_key)
);
CREATE INDEX IF NOT EXISTS runs_by_time ON runs (started);
CREATE TABLE IF NOT EXISTS server_metrics (
    experiment_id TEXT NOT NULL,
    run_key TEXT NOT NULL,
    ts REAL NOT NULL,
    name TEXT NOT NULL,
    labels TEXT NOT NULL DEFAULT '',
    value REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS server_metrics_by_run ON server_metrics (experiment_id, run_key);
"""


def read_samples(path: Path, columns: list[str] | None = None) -> pd.DataFrame:
    """A run's samples file, read as a regular file of bounded size (a FIFO put in its place under
    OUT is refused, never waited on): inputs.InputError otherwise, one sentence."""
    return pd.read_parquet(io.BytesIO(read_bytes(path, DATA_BYTES, "samples file")), columns=columns)


class StoreError(Exception):
    """The store can't be used as asked; the message is one sentence for the user."""


def store_path(out: Path | str, store: Path | None = None) -> Path:
    """The store a command reads and writes: STORE if given, else OUT/lab.db."""
    return store or Path(out) / "lab.db"


def check_experiment_name(name: str) -> str:
    """``name`` if it is a valid experiment name, else StoreError saying what is allowed."""
    if not EXPERIMENT_NAME.fullmatch(name) or ".." in name:
        raise StoreError(f"EXPERIMENT={name!r} is not an experiment name: use {EXPERIMENT_NAME_RULE}")
    return name


def experiment_dir(root: Path | str, name: str) -> Path:
    """The folder of experiment ``name`` under ``root`` (reports, samples, work files)."""
    return Path(root) / check_experiment_name(name)


def describe_sqlite_error(path: Path | str, error: Exception) -> str:
    """One sentence for an SQLite error on the store at ``path``: what happened and what to do."""
    text = str(error.__cause__ or error) if "Execution failed" in str(error) else str(error)
    text = text.split("\n")[0]
    if "locked" in text or "busy" in text:
        return (f"{path}: the store is locked by another process (waited {LOCK_TIMEOUT_S:.0f} s): "
                f"let the other lab command finish, or use another OUT=")
    if "not a database" in text or "encrypted" in text:
        return (f"{path}: not a lab database, not even SQLite ({text}); the file was not "
                f"changed: move it away or use another OUT=")
    if "malformed" in text or "corrupt" in text:
        return (f"{path}: the store is damaged ({text}); nothing was written: restore it from a "
                f"copy, salvage it with `sqlite3 {path} .recover`, or use another OUT=")
    return f"{path}: the store cannot be used ({text}); nothing was written"


# Run settings added after stores were made, at the value that measures as before: left out of a
# run's identity there, so an experiment taken before them resumes instead of starting over.
LATER_RUN_SETTINGS = {"warmup_runs": 0}


def run_identity(resolved: dict[str, Any], repeat: int) -> str:
    """A run's identity: a hash of its resolved scenario (minus provenance) and its repeat index."""
    body = redact({k: v for k, v in resolved.items() if k != "sources"})  # no hash of a key
    if isinstance(body.get("run"), dict):
        body["run"] = {k: v for k, v in body["run"].items()
                       if k not in LATER_RUN_SETTINGS or v != LATER_RUN_SETTINGS[k]}
    text = json.dumps({"scenario": body, "repeat": repeat}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class RunRecord:
    """Everything about one finished run except its raw samples and server time series."""

    experiment_id: str
    run_key: str
    step: str
    scenario_name: str
    scenario: dict[str, Any]
    status: RunStatus
    started: float
    ended: float
    point: dict[str, Any] = field(default_factory=dict)
    repeat: int = 0
    host: str = ""
    gpu_model: str = ""
    gpu_count: int = 0
    vllm_version: str = ""
    backend: str = ""
    error: str = ""
    summary: RunSummary = field(default_factory=RunSummary)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise StoreError(f"run status {self.status!r} is not one of {', '.join(STATUSES)}")
        self.status = RunStatus(self.status)
        self.summary = RunSummary.of(self.summary)  # a mapping of its figures will do


class Store:
    """The lab's results store at ``path`` (created on first use); ``with Store(path) as store:``
    closes it on the way out."""

    def __init__(self, path: Path | str = DEFAULT_PATH):
        self.path = Path(path)
        self.samples_dir = self.path.with_name(self.path.stem + ".samples")
        self._prepare_folder()
        self._conn = self._connect()
        self._migrate()

    # -- opening ---------------------------------------------------------------------------
    def _prepare_folder(self) -> None:
        folder = self.path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"{folder}: cannot create the reports folder ({e.strerror})") from None
        # SQLite writes the database and its -wal, -shm and -journal files: a link there would
        # put the lab's writes outside OUT (the samples are checked when one is written).
        for name in ("", "-wal", "-shm", "-journal"):
            self._inside(self.path.with_name(self.path.name + name))
        probe = self.path if self.path.exists() else folder
        if not os.access(probe, os.W_OK):
            raise StoreError(f"{probe}: not writable; the store needs write access "
                             f"(choose another reports folder with OUT=)")

    def _inside(self, path: Path) -> Path:
        """``path`` inside the store's folder with no link on the way, else StoreError."""
        try:
            return outdir.inside(self.path.parent, path)
        except outdir.OutsideOut as e:
            raise StoreError(str(e)) from None

    def _connect(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(self.path, timeout=LOCK_TIMEOUT_S, isolation_level=None)
            conn.execute(f"PRAGMA busy_timeout={int(LOCK_TIMEOUT_S * 1000)}")
            self._refuse_foreign(conn)
            self._enable_wal(conn, LOCK_TIMEOUT_S)
            conn.execute("PRAGMA foreign_keys=ON")
        except sqlite3.OperationalError as e:
            if "locked" in str(e) or "busy" in str(e):
                raise StoreError(describe_sqlite_error(self.path, e)) from None
            raise StoreError(f"{self.path}: cannot be opened ({e}); the store needs write access "
                             f"to its folder") from None
        except sqlite3.DatabaseError as e:
            raise StoreError(describe_sqlite_error(self.path, e)) from None
        return conn

    def _refuse_foreign(self, conn: sqlite3.Connection) -> None:
        """Another program's SQLite file is refused, never given the lab's tables."""
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
                  if not r[0].startswith("sqlite_")}
        if tables and "meta" not in tables and not tables <= _OPTUNA_TABLES | {"experiments", "runs",
                                                                                "server_metrics"}:
            conn.close()
            raise StoreError(f"{self.path}: an SQLite database of another program (tables: "
                             f"{', '.join(sorted(tables)[:5])}), not a lab store; the file was not "
                             f"changed: use another OUT=")

    @staticmethod
    def _enable_wal(conn: sqlite3.Connection, wait_s: float = 30.0) -> None:
        """Switch to WAL; two processes creating the store at once can see 'locked' here
        without SQLite's busy handler being asked, so retry for a while."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _migrate(self) -> None:
        version = self._schema_version()
        if version is not None and version > SCHEMA_VERSION:
            self._conn.close()
            raise StoreError(f"{self.path}: written by store schema version {version}, newer than "
                             f"this lab's {SCHEMA_VERSION}; upgrade the lab to read it "
                             f"(the file was not changed)")
        if version == SCHEMA_VERSION:
            return
        if version is not None and version < SCHEMA_VERSION:
            self._rebuild_runs()  # every older version's CHECK lacks a status of this one
        # executescript issues its own COMMIT, so it runs outside a transaction; every statement
        # is IF NOT EXISTS, so two processes creating the store at once both succeed.
        self._conn.executescript(SCHEMA)
        with self._write() as conn:
            conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)",
                         (str(SCHEMA_VERSION),))

    def _rebuild_runs(self) -> None:
        """Rebuild the runs table with this version's statuses (SQLite cannot alter a CHECK)."""
        columns = [r[1] for r in self._conn.execute("PRAGMA table_info(runs)")]
        names = ", ".join(columns)
        picked = ", ".join("CASE status WHEN 'client-overloaded' THEN 'client-limited' ELSE status END"
                           if c == "status" else c for c in columns)
        runs_ddl = SCHEMA[SCHEMA.index("CREATE TABLE IF NOT EXISTS runs"):SCHEMA.index("CREATE INDEX")]
        with self._write() as conn:
            conn.execute("ALTER TABLE runs RENAME TO runs_v1")
            conn.execute(runs_ddl)
            conn.execute(f"INSERT INTO runs ({names}) SELECT {picked} FROM runs_v1")
            conn.execute("DROP TABLE runs_v1")

    def _schema_version(self) -> int | None:
        try:
            row = self._conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except sqlite3.OperationalError:
            return None  # a new, empty database
        except sqlite3.DatabaseError as e:
            raise StoreError(describe_sqlite_error(self.path, e)) from None
        return int(row[0]) if row else None

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; BEGIN IMMEDIATE so two writers queue instead of deadlocking."""
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        else:
            self._conn.execute("COMMIT")

    def close(self) -> None:
        """Close the connection."""
        self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # on every way out: a command that fails mid-read leaves no open connection

    # -- writing ---------------------------------------------------------------------------
    def create_experiment(self, experiment_id: str, step: str, scenario_name: str,
                          meta: dict[str, Any] | None = None) -> str:
        """Record an experiment (idempotent: an existing one with this id is kept, for resume);
        StoreError when the id is another step's experiment (a sweep's runs never go into a
        baseline's)."""
        if step not in STEPS:
            raise StoreError(f"step {step!r} is not one of {', '.join(STEPS)}")
        check_experiment_name(experiment_id)
        with self._write() as conn:
            conn.execute("INSERT OR IGNORE INTO experiments VALUES (?, ?, ?, ?, ?)",
                         (experiment_id, step, scenario_name, time.time(),
                          json.dumps(redact(meta or {}), default=str)))
            kept = conn.execute("SELECT step FROM experiments WHERE id=?", (experiment_id,)).fetchone()
        if kept[0] != step:
            raise StoreError(f"EXPERIMENT={experiment_id} is a {kept[0]} experiment; a {step} does "
                             f"not add its runs to it: leave EXPERIMENT out for a new experiment, "
                             f"or name another")
        return experiment_id

    def update_meta(self, experiment_id: str, **fields: Any) -> None:
        """Add or replace fields of an experiment's meta (what a plan learned while it ran: the
        precision each point reached, the host's run-to-run noise)."""
        meta = {**self.experiment(experiment_id)["meta"], **fields}
        with self._write() as conn:
            conn.execute("UPDATE experiments SET meta_json=? WHERE id=?",
                         (json.dumps(redact(meta), default=str), experiment_id))

    def record_run(self, run: RunRecord, samples: pd.DataFrame | None = None,
                   server_metrics: pd.DataFrame | None = None) -> None:
        """Write one finished run: its samples file first, then its rows in one transaction.

        An interruption before the commit leaves no row, so a resume measures the run again;
        the samples file is written to a temporary name and renamed, so it is never half a file.
        """
        samples_file = ""
        if samples is not None and len(samples):
            samples_file = f"{run.experiment_id}/{run.run_key}.parquet"
            target = self._inside(experiment_dir(self.samples_dir, run.experiment_id)
                                  / f"{run.run_key}.parquet")
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(f".tmp{os.getpid()}")
            try:
                samples.to_parquet(tmp, index=False)
                os.replace(tmp, target)
            except OSError as e:  # a full disk: no half file left, no row written
                tmp.unlink(missing_ok=True)
                raise OSError(e.errno, f"{e.strerror or e} while writing run {run.run_key}'s "
                                       f"samples; that run is not recorded", str(target)) from None
        figures = run.summary.record()
        summary = {k: v for k, v in figures.items() if k not in SUMMARY_COLUMNS}
        columns = ["experiment_id", "run_key", "step", "scenario_name", "scenario_json", "point_json",
                   "repeat", "host", "gpu_model", "gpu_count", "vllm_version", "backend", "status",
                   "error", "started", "ended", *SUMMARY_COLUMNS, "summary_json", "samples_file"]
        values = [run.experiment_id, run.run_key, run.step, run.scenario_name,
                  json.dumps(redact(run.scenario), default=str),
                  json.dumps(redact(run.point), default=str),
                  run.repeat, run.host, run.gpu_model, run.gpu_count, run.vllm_version, run.backend,
                  run.status, run.error, run.started, run.ended,
                  *[as_float(figures.get(c)) for c in SUMMARY_COLUMNS],
                  json.dumps(summary, default=str), samples_file]
        marks = ", ".join("?" for _ in columns)
        with self._write() as conn:
            conn.execute("DELETE FROM server_metrics WHERE experiment_id=? AND run_key=?",
                         (run.experiment_id, run.run_key))
            conn.execute(f"INSERT OR REPLACE INTO runs ({', '.join(columns)}) VALUES ({marks})",
                         values)
            if server_metrics is not None and len(server_metrics):
                conn.executemany(
                    "INSERT INTO server_metrics VALUES (?, ?, ?, ?, ?, ?)",
                    [(run.experiment_id, run.run_key, float(ts), str(name), str(labels), float(v))
                     for ts, name, labels, v in server_metrics[["ts", "name", "labels", "value"]]
                     .itertuples(index=False)])

    def export(self, experiment_ids: list[str], dest: Path | str,
               metric_names: tuple[str, ...] | None = None) -> Store:
        """Copy some experiments (runs, the named server series, sample files) into a new store.

        For sharing a result without the whole database: a committed example, a bug report.
        """
        out = Store(dest)
        marks = ", ".join("?" for _ in experiment_ids)
        with out._write() as conn:
            conn.execute("ATTACH DATABASE ? AS src", (str(self.path),))
            conn.execute(f"INSERT OR REPLACE INTO experiments SELECT * FROM src.experiments "
                         f"WHERE id IN ({marks})", experiment_ids)
            conn.execute(f"INSERT OR REPLACE INTO runs SELECT * FROM src.runs "
                         f"WHERE experiment_id IN ({marks})", experiment_ids)
            names = ""
            if metric_names:
                names = f" AND name IN ({', '.join('?' for _ in metric_names)})"
            conn.execute(f"INSERT INTO server_metrics SELECT * FROM src.server_metrics "
                         f"WHERE experiment_id IN ({marks}){names}",
                         [*experiment_ids, *(metric_names or ())])
        out._conn.execute("DETACH DATABASE src")
        for exp in experiment_ids:
            for f in (self.samples_dir / exp).glob("*.parquet"):
                (out.samples_dir / exp).mkdir(parents=True, exist_ok=True)
                (out.samples_dir / exp / f.name).write_bytes(read_bytes(f, DATA_BYTES, "samples file"))
        return out

    # -- reading ---------------------------------------------------------------------------
    def experiments(self) -> pd.DataFrame:
        """Every experiment, newest first."""
        return pd.read_sql_query("SELECT * FROM experiments ORDER BY created DESC", self._conn)

    def newest_experiment(self, prefix: str = "") -> str | None:
        """The id of the newest experiment (whose id starts with ``prefix``), or None."""
        row = self._conn.execute("SELECT id FROM experiments WHERE substr(id, 1, length(?1)) = ?1 "
                                 "ORDER BY created DESC LIMIT 1", (prefix,)).fetchone()
        return row[0] if row else None

    def experiment(self, experiment_id: str) -> dict[str, Any]:
        """One experiment's row, or StoreError naming the known ones."""
        row = self._conn.execute("SELECT id, step, scenario_name, created, meta_json FROM experiments "
                                 "WHERE id=?", (experiment_id,)).fetchone()
        if row is None:
            known = [r[0] for r in self._conn.execute(
                "SELECT id FROM experiments ORDER BY created DESC LIMIT 5")]
            raise StoreError(f"{self.path}: no experiment {experiment_id!r} "
                             f"(newest: {', '.join(known) or 'none'})")
        return {"id": row[0], "step": row[1], "scenario_name": row[2], "created": row[3],
                "meta": json.loads(row[4])}

    def runs(self, experiment_id: str | None = None, family: bool = False) -> pd.DataFrame:
        """Runs (all, or one experiment's), with ``point`` and ``summary`` decoded. ``family``: also
        the runs of the experiments named ``<experiment_id>-...`` (autotune's candidates)."""
        query = "SELECT * FROM runs"
        params: tuple = ()
        if experiment_id is not None and family:
            query += " WHERE experiment_id=? OR substr(experiment_id, 1, ?)=?"
            params = (experiment_id, len(experiment_id) + 1, experiment_id + "-")
        elif experiment_id is not None:
            query += " WHERE experiment_id=?"
            params = (experiment_id,)
        df = pd.read_sql_query(query + " ORDER BY started", self._conn, params=params)
        df["point"] = df["point_json"].map(json.loads)
        df["summary"] = df["summary_json"].map(json.loads)
        return df

    def runs_between(self, start: float, end: float) -> pd.DataFrame:
        """Every run started in [start, end), oldest first, as stored (nothing decoded)."""
        return pd.read_sql_query("SELECT * FROM runs WHERE started >= ? AND started < ? ORDER BY started",
                                 self._conn, params=(start, end))

    def relabel_points(self, experiment_id: str, point: dict[str, Any], new_point: dict[str, Any]) -> int:
        """Give the runs of ``experiment_id`` at ``point`` the point ``new_point``; return how many."""
        with self._write() as conn:
            cur = conn.execute("UPDATE runs SET point_json=? WHERE experiment_id=? AND point_json=?",
                               (json.dumps(redact(new_point), default=str), experiment_id,
                                json.dumps(redact(point), default=str)))
        return cur.rowcount

    def finished_keys(self, experiment_id: str) -> set[str]:
        """Run keys a resume skips: every recorded run but those that may pass on a second try.

        A crash, a start timeout or an unreachable host can be the machine's doing (a killed
        server, a slow disk, a host down), so a resume measures those again; an OOM or a refused
        flag would only fail the same way.
        """
        marks = ", ".join("?" for _ in RETRIED_ON_RESUME)
        return {r[0] for r in self._conn.execute(
            f"SELECT run_key FROM runs WHERE experiment_id=? AND status NOT IN ({marks})",
            (experiment_id, *RETRIED_ON_RESUME))}

    def samples(self, experiment_id: str, run_key: str, columns: list[str] | None = None) -> pd.DataFrame:
        """The raw per-request samples of one run (empty when it has none), or some columns of them."""
        row = self._conn.execute("SELECT samples_file FROM runs WHERE experiment_id=? AND run_key=?",
                                 (experiment_id, run_key)).fetchone()
        if not row or not row[0]:
            return pd.DataFrame()
        return read_samples(self.samples_dir / row[0], columns)

    def samples_files(self, runs: pd.DataFrame) -> list[Path | None]:
        """Where each of ``runs``' samples are (None: it has none), for reading many runs in
        parallel threads (the connection stays in this one)."""
        return [self.samples_dir / f if f else None for f in runs["samples_file"]]

    def server_metrics(self, experiment_id: str, run_key: str | None = None) -> pd.DataFrame:
        """The scraped server time series of one run or a whole experiment."""
        query = "SELECT * FROM server_metrics WHERE experiment_id=?"
        params: tuple = (experiment_id,)
        if run_key is not None:
            query += " AND run_key=?"
            params += (run_key,)
        return pd.read_sql_query(query + " ORDER BY ts", self._conn, params=params)

