"""``deepmetric study`` (variants x seeds) and ``deepmetric tune`` (hyper-parameter search)."""
from __future__ import annotations

import argparse
import sys

from deepmetric.cli.common import add_command
from deepmetric.run import rundir


# --------------------------------------------------------------------------- study
def add_study_parser(sub) -> None:
    p = add_command(sub, _run_study, "study")
    p.add_argument("study", help="study file (YAML: base, overrides, variants, seeds, benchmarks, compare)")
    p.add_argument("--workers", type=int, default=None,
                   help="runs at once on this machine (default: the file's 'workers', else 1): "
                        "worker processes with cores/N torch threads each")
    p.add_argument("--storage", default=None,
                   help="Optuna storage URL of the runs (default sqlite:///OUT/study.db; postgresql://... "
                        "to share a study between machines)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a child of --workers K
    p.add_argument("--out", default=None, help="study directory (default: the file's 'out_dir')")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="config overrides for every run, after the variants' (e.g. train.epochs=1 "
                        "with --out /tmp/smoke for a quick check of the whole study)")
    p.add_argument("--only", nargs="+", default=None, metavar="KEY",
                   help="train only the runs under these keys, by whole path parts (HBN or "
                        "HBN/seed0; 'triplet' does not match triplet_hard)")
    p.add_argument("--summary", action="store_true",
                   help="train nothing: rewrite the results files from the finished runs")
    p.add_argument("--list", action="store_true", help="list the runs and whether they are finished")
    p.add_argument("--progress", action="store_true", help="show the per-epoch progress bars of each run")
    p.add_argument("--commit", action="store_true",
                   help="git-commit the result files (only those) after every run")


def _run_study(args: argparse.Namespace) -> int:
    from deepmetric.workflows.study import (default_storage, open_trials, run_study, run_worker, select_runs,
                                           sync_finished, write_results)
    from deepmetric.workflows.study_file import load_study

    study = load_study(args.study, out_dir=args.out, overrides=args.overrides)
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers: expected an int >= 1, got {args.workers}")
    storage = args.storage or default_storage(study)
    if args.worker:  # one of the processes of 'deepmetric study --workers K'
        from deepmetric.workflows.engine import worker_threads

        result = run_worker(study, storage=storage, only=args.only, threads=worker_threads(), progress=args.progress)
        return 130 if result["interrupted"] else 0
    if args.list:
        runs = select_runs(study, args.only)
        sync_finished(study, open_trials(study, storage).get_trials(deepcopy=False))
        for run in runs:
            state = "finished" if run.finished else ("partial" if (run.out_dir / rundir.LAST).is_file() else "-")
            print(f"{run.key:40s} {state:9s} {run.out_dir}")
        return 0
    if args.summary:
        if args.only:  # it was ignored: the tables always cover every run
            raise ValueError("--only does not apply to --summary: the tables cover every run of the study")
        paths = write_results(study, storage=storage)
        print(f"wrote {', '.join(str(p) for p in paths.values())}")
        return 0
    result = run_study(study, workers=args.workers, progress=args.progress, commit=args.commit, only=args.only,
                       storage=storage, overrides=args.overrides)
    print(f"summary: {result['paths']['md']}")
    if result["interrupted"]:
        return 130
    return 1 if result["failed"] else 0


# --------------------------------------------------------------------------- tune
def add_tune_parser(sub) -> None:
    p = add_command(sub, _run_tune, "tune")
    p.add_argument("recipe", help="the config to tune (YAML, as for 'deepmetric train'); with --postprocess a "
                                  "finished checkpoint (best.pt / last.pt)")
    p.add_argument("--space", default=None, help="search space (YAML: objective, params, pruner, sampler); "
                                                  "required unless --postprocess")
    p.add_argument("--trials", type=int, default=None,
                   help="trials to finish or prune (counted over every worker and machine of the study); "
                        "required unless --postprocess")
    p.add_argument("--postprocess", action="store_true",
                   help="fast mode: choose the retrieval post-processing (whiten, dba, aqe) of the checkpoint RECIPE "
                        "on its validation split, without training (seconds after one embedding pass); writes "
                        "OUT/postprocess.yaml; never reads the test split")
    p.add_argument("--metric", default=None,
                   help="with --postprocess: the validation metric (default cross_domain_map@r for a cross-domain "
                        "run, else map@r)")
    p.add_argument("--kreciprocal", action="store_true", help="with --postprocess: also try k-reciprocal re-ranking")
    p.add_argument("--device", default="auto", help="with --postprocess: where the model embeds (auto, cpu, cuda[:i])")
    p.add_argument("--count", choices=("finished", "completed"), default="finished",
                   help="what --trials counts: finished or pruned trials (default), or completed ones only "
                        "(pruned ones do not count: every tune gets the same number of complete trials)")
    p.add_argument("--max-trials", type=int, default=None,
                   help="with --count completed: stop after this many finished or pruned trials (default 3 x --trials)")
    p.add_argument("--workers", type=int, default=1,
                   help="trials at once on this machine (processes with cores/K torch threads each)")
    p.add_argument("--storage", default=None,
                   help="Optuna storage URL (default sqlite:///OUT/tune.db; postgresql://... to share a study)")
    p.add_argument("--study-name", default=None, help="study name in the storage (default RECIPE__SPACE)")
    p.add_argument("--out", default=None, help="tune directory (default runs/tune/<study name>; with --postprocess: the checkpoint's folder/postprocess)")
    p.add_argument("--report-only", action="store_true", help="train nothing: rewrite the outputs from the storage")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a child of --workers K
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides for every trial (anywhere on the line, also after the options)")


def _run_tune_postprocess(args: argparse.Namespace) -> int:
    from deepmetric.workflows.tune_postprocess import tune_postprocess

    res = tune_postprocess(args.recipe, metric=args.metric, out=args.out, device=args.device,
                           kreciprocal=args.kreciprocal)
    print(f"[tune] validation ({res['split']}, {res['images']} images, embedded in {res['embed_seconds']:.0f} s), "
          f"{res['metric']}, {len(res['trials'])} lists in {res['seconds']:.0f} s:")
    for t in res["trials"]:
        print(f"  {100 * t['value']:6.2f}  {t['spelled']}")
    print(f"[tune] chosen: {res['spelled']} ({100 * res['value']:.2f}, without {100 * res['baseline']:.2f})")
    for name, path in res["files"].items():
        print(f"[tune] {name:<6} {path}")
    return 0


def _refuse_options(args: argparse.Namespace, why: str, given: dict) -> None:
    """The options of the other tune mode, which would be ignored silently, are refused."""
    used = [flag for flag, value in given.items() if value]
    if used:
        raise ValueError(f"{', '.join(used)}: not taken here ({why}); leave {'them' if len(used) > 1 else 'it'} out")


def _run_tune(args: argparse.Namespace) -> int:
    from deepmetric.workflows.tune import prepare_tune, report_tune, run_tune, run_worker
    from deepmetric.workflows.tune_space import TuneError

    if args.postprocess:
        _refuse_options(args, "--postprocess tunes the post-processing of a checkpoint",
                        {"--space": args.space, "--trials": args.trials, "--max-trials": args.max_trials,
                         "--workers": args.workers != 1, "--storage": args.storage, "--study-name": args.study_name,
                         "--report-only": args.report_only, "--count": args.count != "finished",
                         "KEY=VALUE overrides": args.overrides})
        return _run_tune_postprocess(args)
    _refuse_options(args, "they apply to --postprocess",
                    {"--metric": args.metric, "--kreciprocal": args.kreciprocal, "--device": args.device != "auto"})
    if args.space is None or args.trials is None:
        print("deepmetric tune: error: the following arguments are required: --space, --trials "
              "(or --postprocess with a checkpoint)", file=sys.stderr)
        return 2

    try:
        if args.workers < 1:
            raise TuneError(f"--workers: expected an int >= 1, got {args.workers}")
        setup = prepare_tune(args.recipe, args.space, trials=args.trials, out=args.out, storage=args.storage,
                             study_name=args.study_name, overrides=args.overrides, count=args.count,
                             max_trials=args.max_trials)
        if args.worker:  # one of the processes of 'deepmetric tune --workers K'
            from deepmetric.workflows.engine import worker_threads

            run_worker(setup, threads=worker_threads())
            return 0
        paths = report_tune(setup) if args.report_only else run_tune(setup, workers=args.workers)
    except KeyboardInterrupt:
        print("deepmetric tune: interrupted; rerun the same command to continue the study", file=sys.stderr)
        return 130
    except TuneError as exc:
        print(f"deepmetric tune: error: {exc}", file=sys.stderr)
        return 2
    for name, path in paths.items():
        print(f"[tune] {name:<22} {path}")
    return 0

