"""The backend a command measures on: the predictor, or live servers on the inventory's hosts
(provisioned first), behind a ``DeadlineGuard`` when the command has a DEADLINE."""

from __future__ import annotations

import os

from vllm_lab import serving
from vllm_lab.backends import QUIET, Backend, LiveBackend, PredictBackend, RunHooks
from vllm_lab.commands.settings import Settings
from vllm_lab.deadline import DeadlineGuard, Timing
from vllm_lab.store import StoreError


def make_backend(settings: Settings, experiment: str = "", hooks: RunHooks = QUIET) -> Backend:
    """The backend that measures the points: the predictor, or live servers (provisioned first)
    that tell ``hooks`` (the command's progress) the phases and figures of each run."""
    if settings.backend == "predict":
        return PredictBackend(band=True)
    serving.check_inventory(settings.inventory)  # a bad inventory is refused before anything runs
    # Idempotent: on a provisioned host this changes nothing and takes a few seconds. It claims
    # the instances first: another lab process's are refused (InstanceBusy) before any change.
    backend = LiveBackend(settings.backend, settings.inventory,
                          api_key=os.environ.get("VLLM_API_KEY") or None,
                          processes=settings.loadgen_processes, experiment=experiment,
                          live_host=settings.live_host, hooks=hooks)
    print(f"provisioning {settings.inventory} (playbooks/provision.yml)", flush=True)
    try:
        serving.provision(settings.inventory, experiment=experiment)
    except RuntimeError as e:
        raise StoreError(f"{settings.inventory}: hosts could not be provisioned: {e}") from None
    except KeyboardInterrupt:
        backend.holding = True  # it may have claimed instances before the stop: given back at exit
        raise
    backend.holding = True
    return backend


def guarded_backend(settings: Settings, exp_id: str, hooks: RunHooks = QUIET) -> Backend:
    """The experiment's backend, behind a DeadlineGuard when DEADLINE is set (its expected times
    from this experiment's runs already in the store)."""
    backend = make_backend(settings, exp_id, hooks)
    if settings.deadline is None:
        return backend
    return DeadlineGuard(backend, settings.deadline,
                         Timing.from_store(settings.store_path, exp_id, backend.name))
