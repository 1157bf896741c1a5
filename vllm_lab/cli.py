"""The lab's command line: parse, call one function, print. The Makefile calls this."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from vllm_lab import lint as lint_mod
from vllm_lab import plans, scenarios, serving
from vllm_lab.store import StoreError


def _scenario_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", default="default", help="scenario name or file")
    p.add_argument("--hardware", default=None, help="hardware preset name or file (default h200)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override one key, e.g. serve.max-num-seqs=128")


def _split_sets(text: str | None) -> list[str]:
    """SET="a.b=1 c.d=2" from make arrives as one string."""
    return text.split() if text else []


def cmd_lint(args: argparse.Namespace) -> int:
    """Lint one scenario, or every shipped one with --all; exit 1 on any error."""
    names = _all_scenario_names() if args.all else [args.scenario]
    failed = False
    for name in names:
        layers = scenarios.load_layers(name, args.hardware, args.overrides)
        scenario = scenarios.validate(layers)
        if args.vllm_version:
            scenario = scenario.model_copy(update={"vllm_version": args.vllm_version})
        findings = lint_mod.lint(scenario, layers)
        print(f"{name}: " + (f"{len(findings)} finding(s)" if findings else "ok"))
        for finding in findings:
            print(f"  {finding}")
        # The guide/ templates are kept as the guide wrote them; with --all their findings are
        # the worked example, not a failure.
        as_written = args.all and name.startswith("guide/")
        failed |= not as_written and any(f.severity == "error" for f in findings)
    return 1 if failed else 0


def _all_scenario_names() -> list[str]:
    guide = sorted((scenarios.SCENARIO_DIR / "guide").glob("*.yaml"))
    return scenarios.available()["scenarios"] + [f"guide/{p.stem}" for p in guide]


def cmd_show(args: argparse.Namespace) -> int:
    """Print the resolved scenario as YAML: what a run would record."""
    scenario = scenarios.resolve(args.scenario, args.hardware, args.overrides)
    print(yaml.safe_dump(scenario.to_record(), sort_keys=False), end="")
    return 0


def _run_args(p: argparse.ArgumentParser) -> None:
    _scenario_args(p)
    p.add_argument("--inventory", type=Path, default=Path("inventory/local.yml"))
    p.add_argument("--backend", choices=("twin", "vllm", "predict"), default="twin")
    p.add_argument("--out", type=Path, default=Path("reports"), help="reports folder")
    p.add_argument("--store", type=Path, default=None, help="store file (default OUT/lab.db)")
    p.add_argument("--experiment", default=None, help="experiment id (to resume or name it)")
    p.add_argument("--resume", action="store_true", help="continue the experiment (or the newest alike)")
    p.add_argument("--repeats", type=int, default=None, help="runs per point")
    p.add_argument("--spread", action="store_true", help="spread points over all inventory hosts")


def _backend(args: argparse.Namespace):
    from vllm_lab.backends import LiveBackend, PredictBackend
    if args.backend == "predict":
        return PredictBackend()
    # Idempotent: on a provisioned host this changes nothing and takes a few seconds.
    print(f"provisioning {args.inventory} (playbooks/provision.yml)", flush=True)
    try:
        serving.provision(args.inventory)
    except RuntimeError as e:
        raise StoreError(f"{args.inventory}: hosts could not be provisioned: {e}") from None
    return LiveBackend(args.backend, args.inventory, api_key=os.environ.get("VLLM_API_KEY") or None)


def _experiment_id(args, step: str, scenario, param: str | None, store_path: Path) -> str:
    """EXPERIMENT if given; with --resume the newest experiment of this step, scenario and param."""
    if args.experiment:
        return args.experiment
    if args.resume:
        from vllm_lab.store import Store
        store = Store(store_path)
        exps = store.experiments()
        store.close()
        prefix = plans.experiment_name(step, scenario, param)[: -len("-YYYYmmdd-HHMMSS")]
        alike = exps[exps["id"].str.startswith(prefix + "-")]
        if alike.empty:
            raise StoreError(f"{store_path}: nothing to resume for {prefix}; run without RESUME=1")
        return str(alike.iloc[0]["id"])
    return plans.experiment_name(step, scenario, param)


def _take(args, step: str, scenario, points, meta: dict, param: str | None = None) -> int:
    from vllm_lab import report
    store_path = args.store or args.out / "lab.db"
    exp_id = _experiment_id(args, step, scenario, param, store_path)
    plan = plans.Plan(exp_id, step, points, meta)
    hosts = serving.serve_hosts(args.inventory) if args.spread else [None]
    print(f"{step}: experiment {exp_id}, {len(points)} runs, backend {args.backend}")

    def progress(point, m):
        s = m.summary
        figures = (f"{s.get('output_throughput', 0):.0f} tok/s, TTFT p50 "
                   f"{(s.get('ttft_p50') or 0) * 1000:.0f} ms, TPOT p50 {(s.get('tpot_p50') or 0) * 1000:.1f} ms"
                   if m.status in ("ok", "client-overloaded") else m.error.splitlines()[0][:120])
        print(f"  {point.values or 'baseline'} repeat {point.repeat}: {m.status}: {figures}", flush=True)

    try:
        counts = plans.execute(plan, _backend(args), store_path, args.out / ".work", hosts, progress)
    except KeyboardInterrupt:
        print(f"lab: interrupted; finished runs are kept. Continue with: make {step} ... "
              f"RESUME=1 EXPERIMENT={exp_id}", file=sys.stderr)
        return 130
    index = report.build(store_path, exp_id, args.out)
    print(f"runs this session: {counts or 'none (all were already recorded)'}")
    print(f"report: {index}")
    return 0


def cmd_baseline(args: argparse.Namespace) -> int:
    """vLLM's defaults on the scenario's traffic, repeated: the reference later steps compare with."""
    scenario = _resolve_checked(args)
    repeats = args.repeats or max(3, scenario.run.repeats)
    return _take(args, "baseline", scenario, plans.baseline_points(scenario, repeats),
                 {"repeats": repeats})


def cmd_sweep(args: argparse.Namespace) -> int:
    """One flag over a ladder of values."""
    scenario = _resolve_checked(args)
    values = plans.parse_values(args.param, args.values) if args.values else \
        plans.default_values(args.param, scenario)
    points = plans.sweep_points(scenario, args.param, values, args.repeats or scenario.run.repeats)
    for p in points:
        _lint_or_note(p)
    return _take(args, "sweep", scenario, points, {"param": args.param, "values": values}, args.param)


def _lint_or_note(point) -> None:
    """A value vLLM would refuse is still a data point: it is measured (and recorded as refused)."""
    for f in lint_mod.lint(point.scenario):
        if f.severity == "error":
            print(f"  note: {point.values}: {f.message}")


def _resolve_checked(args: argparse.Namespace):
    """Resolve the scenario and stop on lint errors: nothing is launched with a refused flag."""
    layers = scenarios.load_layers(args.scenario, args.hardware, args.overrides)
    scenario = scenarios.validate(layers)
    errors = [f for f in lint_mod.lint(scenario, layers) if f.severity == "error"]
    if errors:
        raise scenarios.ScenarioError(f"{errors[0]} (make lint SCENARIO={args.scenario} lists all)")
    return scenario


def cmd_report(args: argparse.Namespace) -> int:
    """Rebuild an experiment's report from the store alone."""
    from vllm_lab import report
    store_path = args.store or args.out / "lab.db"
    experiment = args.experiment
    if not experiment:
        from vllm_lab.store import Store
        store = Store(store_path)
        exps = store.experiments()
        store.close()
        if exps.empty:
            raise StoreError(f"{store_path}: no experiments yet; run make baseline or make sweep first")
        experiment = str(exps.iloc[0]["id"])
    print(f"report: {report.build(store_path, experiment, args.out)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every lab command."""
    parser = argparse.ArgumentParser(prog="lab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("lint", help="check a scenario's vLLM flags before anything runs")
    _scenario_args(p)
    p.add_argument("--all", action="store_true", help="lint every shipped scenario")
    p.add_argument("--vllm-version", default=None, help="target vLLM version (default: scenario's)")
    p.set_defaults(func=cmd_lint)

    p = sub.add_parser("show", help="print the resolved scenario")
    _scenario_args(p)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("baseline", help="measure vLLM's defaults on the scenario's traffic")
    _run_args(p)
    p.set_defaults(func=cmd_baseline)

    p = sub.add_parser("sweep", help="sweep one flag over a ladder of values")
    _run_args(p)
    p.add_argument("--param", required=True, help="flag (max-num-seqs) or path (load.shape.level)")
    p.add_argument("--values", default=None, help="comma-separated values (default: a ladder)")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("report", help="rebuild an experiment's report from the store")
    p.add_argument("--experiment", default=None, help="experiment id (default: the newest)")
    p.add_argument("--out", type=Path, default=Path("reports"))
    p.add_argument("--store", type=Path, default=None)
    p.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one lab command; a bad input is one sentence on stderr and exit status 2."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (scenarios.ScenarioError, StoreError) as e:
        print(f"lab: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lab: interrupted; finished runs are in the store", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
