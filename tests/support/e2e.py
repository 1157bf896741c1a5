"""The lab's own CLI on the live twin, as the end-to-end tests run it: a private inventory (its
own port and host folder), the cpu-demo GPU so two shared cores keep real time, short runs."""

import sys
from pathlib import Path

import pandas as pd

from tests.support.processes import private_inventory
from vllm_lab.store import Store

REPO = Path(__file__).resolve().parents[2]

# 30 s of load: a closed loop's window ends at its last send, and a run whose fill takes more
# than half the time its load is sent is unsteady (store.RunStatus), not measured; one sequence
# at a time for six users takes several seconds to fill on cpu-demo.
SETS = ["load.shape.level=6", "load.stop.duration_s=30", "workload.source=alpaca-like",
        "run.warmup_requests=2"]


def private_lab(tmp_path_factory) -> Path:
    """A private local inventory and reports folder (a module's fixture)."""
    tmp = tmp_path_factory.mktemp("e2e")
    private_inventory(tmp)
    return tmp


def lab_cmd(lab: Path, *args: str) -> list[str]:
    sets = [x for s in SETS for x in ("--set", s)]
    return [sys.executable, str(REPO / "scripts/lab.py"), "sweep", "--param", "max-num-seqs",
            "--hardware", "cpu-demo", "--inventory", str(lab / "inv.yml"), "--out", str(lab / "reports"),
            *sets, *args]


def runs_by_value(store: Store, exp: str) -> pd.DataFrame:
    runs = store.runs(exp)
    return runs.assign(value=runs["point"].map(lambda p: p["max-num-seqs"])).set_index("value")
