"""Hooks for every test (fixtures go here too); shared helpers are modules in tests/support/.

The ``integration`` marker is kept honest here: a test without it may not start a process (a
server, Locust, ssh, ansible-playbook, make, or any other program), so `make test-fast`
(``-m "not integration"``) starts none. A test that does fails with a sentence saying so.
"""

from __future__ import annotations

import os
import subprocess

import pytest


class _ProcessStarted(Exception):
    """A test without the integration marker tried to start a process."""


_STARTED = pytest.StashKey[list]()


def pytest_configure(config):
    """Load matplotlib's font list before any test: on a machine without its cache it runs fc-list
    once, which is matplotlib setting itself up, not a test starting a process. Autotune's
    searches predict in this process (VLLM_LAB_PREDICT_PROCESSES=1).

    Ctrl-C is given back its default handler where the suite was started with it ignored (a
    shell's background job, `nohup make test &`): the lab keeps an inherited ignore on purpose,
    and the tests of how it stops on SIGINT need a SIGINT that a terminal would deliver."""
    import signal

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.font_manager

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # The tests' autotune searches are too small to pay for starting prediction processes (and a
    # test without the integration marker starts none); the test that compares both sets its own.
    os.environ["VLLM_LAB_PREDICT_PROCESSES"] = "1"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (make test, make test-fast): a worker per CPU this process may run on, as
    nproc counts them (pytest-xdist's own count, physical cores, is 1 on some 2-vCPU machines);
    PYTEST_XDIST_AUTO_NUM_WORKERS=N overrides it."""
    return int(os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") or len(os.sched_getaffinity(0)))


def pytest_collection_modifyitems(items):
    """Put the test files with the most slow tests first, then those with the most integration
    tests, each file's tests in their own order.

    `make test` hands whole files to its pytest-xdist workers (``--dist loadfile``: a file's
    module fixtures start once) in this order (``--no-loadscope-reorder``): the long files start
    first and the last to start are short, so the workers finish together. Mark a test ``slow``
    when it takes more than ~30 s, and it is scheduled accordingly.
    """
    weight: dict[str, list[int]] = {}
    for item in items:
        w = weight.setdefault(item.nodeid.split("::")[0], [0, 0])
        w[0] -= bool(item.get_closest_marker("slow"))
        w[1] -= bool(item.get_closest_marker("integration"))
    items.sort(key=lambda item: weight[item.nodeid.split("::")[0]])  # stable: files stay whole


def _starts(item: pytest.Item) -> list[str]:
    return item.stash.setdefault(_STARTED, [])


def _refuse(item: pytest.Item, what: str):
    def guard(*args, **kwargs):
        shown = args[1] if what == "subprocess" else args[:1]  # Popen's argv follows self
        _starts(item).append(f"{what}: {shown!r}")
        raise _ProcessStarted(what)
    return guard


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _no_processes(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _no_processes(item))


def _no_processes(item: pytest.Item):
    """Run one phase of an unmarked test with every way of starting a process refused."""
    if item.get_closest_marker("integration"):
        return (yield)
    real = subprocess.Popen._execute_child
    saved = {name: getattr(os, name) for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp",
                                                  "system", "execv", "execve")}
    subprocess.Popen._execute_child = _refuse(item, "subprocess")
    for name in saved:
        setattr(os, name, _refuse(item, f"os.{name}"))
    try:
        result = yield
    except _ProcessStarted:
        result = None
    finally:
        subprocess.Popen._execute_child = real
        for name, fn in saved.items():
            setattr(os, name, fn)
    if _starts(item):
        # Recorded, not only raised: a test that swallows the exception still fails.
        pytest.fail(f"{item.nodeid} starts a process ({_starts(item)[0]}) but is not marked "
                    "integration: mark it @pytest.mark.integration or keep it in-process",
                    pytrace=False)
    return result


_PREDICTIONS: dict[str, object] = {}


@pytest.fixture
def shared_predictions(monkeypatch):
    """The predictor's answers shared between the tests that ask it the same question.

    A prediction is a pure function of its inputs (flags, profile, model, requests, arrivals,
    seed), and the tests that run a whole autotune, tune or claims on the predictor ask many of
    the same ones: a third of test-fast's predictor time was repeats. A module that is not about
    the predictor itself opts in (``pytestmark = pytest.mark.usefixtures("shared_predictions")``);
    each test gets its own copy of an answer, so none can change another's."""
    import copy
    import hashlib
    import pickle

    from vllm_lab.twin import predictor

    compute = predictor.predict

    def predict(flags, profile, model, requests, arrivals, seed=0):
        key = hashlib.sha1(pickle.dumps((sorted(flags.items()), profile.model_dump_json(), repr(model),
                                         list(requests), arrivals, seed))).hexdigest()
        if key not in _PREDICTIONS:
            _PREDICTIONS[key] = compute(flags, profile, model, requests, arrivals, seed)
        return copy.deepcopy(_PREDICTIONS[key])

    monkeypatch.setattr(predictor, "predict", predict)
