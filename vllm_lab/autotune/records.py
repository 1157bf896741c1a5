"""Where an autotune keeps what is not a run: its plan, the minutes each candidate spent and its
budget, as the meta of its own experiment in the store (step ``autotune``; read back by
``analysis.autotune.load_record``, which also reads a store from before, that kept them in the
Optuna study)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from vllm_lab.analysis.autotune import STEP, Host, Record, Spend
from vllm_lab.store import Store


def keep(store_path: Path, experiment_id: str, record: Record, plan: dict | None = None) -> None:
    """Write the autotune's record (its experiment made first, the first time, with the command's
    plan, which a resume restores)."""
    with Store(store_path) as store:
        store.create_experiment(experiment_id, STEP, record.plan.scenario["name"],
                                {"made_by": plan} if plan else None)
        store.update_meta(experiment_id, **record.meta())


def keep_spend(store_path: Path, experiment_id: str, spend: dict[str, Spend]) -> None:
    """Write what the candidates spent so far."""
    with Store(store_path) as store:
        store.update_meta(experiment_id, spend={k: asdict(v) for k, v in spend.items()})


def keep_host(store_path: Path, experiment_id: str, host: Host) -> None:
    """Write the host's time so far, every phase's."""
    with Store(store_path) as store:
        store.update_meta(experiment_id, host=asdict(host))
