"""What ``deepmetric tune`` writes in its folder: ``best.yaml``, ``best_overrides.json``,
``trials.csv`` / ``trials.md``, Optuna's plots and ``report.html``."""
from __future__ import annotations

import copy
import csv
import json
import math
import os
from pathlib import Path
from typing import Any

import yaml

from deepmetric.run import rundir
from deepmetric.run.config_io import apply_overrides, config_from_dict, read_yaml_mapping

from .engine import display_storage
from .tune_space import format_value
from .tune_study import TuneSetup, open_study, trial_origin, trial_state_name


def trial_rows(setup: TuneSetup, study) -> list[dict]:
    """One row per trial (surplus trials, which never ran, left out)."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get("surplus"):
            continue
        row: dict[str, Any] = {"trial": t.number, "state": trial_state_name(t)}
        if t.user_attrs.get("retry_of") is not None or trial_origin(t) != t.number:
            row["retry_of"] = trial_origin(t)
        for p in setup.space.params:
            if p.name in t.params:
                row[p.name] = p.value_of(t.params)
        row[f"val/{setup.space.metric}"] = t.value
        if t.intermediate_values:
            last = max(t.intermediate_values)
            row["last_epoch"] = last
        row["pruned_at_epoch"] = t.user_attrs.get("pruned_at_epoch")
        if t.datetime_start is not None and t.datetime_complete is not None:
            row["wall_time_s"] = round((t.datetime_complete - t.datetime_start).total_seconds(), 1)
        row["run_dir"] = t.user_attrs.get("run_dir")
        if t.user_attrs.get("note"):  # set by hand on a repaired study (bench/studies/README.md, the fair emoji tunes)
            row["note"] = t.user_attrs["note"]
        rows.append(without_test_metrics(row))
    return rows


def write_trials_csv(rows: list[dict], path: Path) -> Path:
    """``rows`` (:func:`trial_rows`) as ``trials.csv``, a column per key in order of appearance,
    empty cells for missing values; written whole (a temporary file renamed)."""
    columns = list(dict.fromkeys(k for r in rows for k in r)) or ["trial", "state"]
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns})
    os.replace(tmp, path)
    return path


def without_test_metrics(row: dict) -> dict:
    """``row`` without any key that names a test metric (``test/...``, ``test_...``, ``test``):
    trials never evaluate the test split, and a storage written by an older version (which
    recorded the final test metrics) must not bring them into the outputs either."""
    return {k: v for k, v in row.items() if not str(k).lower().startswith("test")}


def _best_trial(setup: TuneSetup, study):
    from optuna.trial import TrialState

    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    if not done:
        return None
    sign = 1.0 if setup.space.direction == "maximize" else -1.0
    return max(done, key=lambda t: (sign * t.value, -t.number))


#: Overrides that only shorten or quieten the trials (``train.epochs=3``, ``train.progress=false``):
#: best.yaml takes the recipe's own values back and says so in its header.
SHORT_RUN_KEYS = ("train.epochs", "train.iterations", "train.progress", "eval.every")


def _undo_short_run_settings(setup: TuneSetup, raw: dict) -> list[str]:
    """Put the recipe's own values of :data:`SHORT_RUN_KEYS` back into ``raw`` where the tune's
    command or space overrode them; returns a note per key (``train.epochs=3 (recipe: 30)``)."""
    original = read_yaml_mapping(setup.recipe, "recipe")
    notes = []
    for text in [*setup.cli_overrides, *setup.space.overrides]:
        key = text.partition("=")[0].strip()
        if key not in SHORT_RUN_KEYS or any(n.startswith(f"{key}=") for n in notes):
            continue
        section, name = key.split(".")
        own = (original.get(section) or {}).get(name) if isinstance(original.get(section), dict) else None
        target = raw.setdefault(section, {})
        if own is None:
            target.pop(name, None)
        else:
            target[name] = own
        notes.append(f"{text} (recipe: {'default' if own is None else own})")
    return notes


def _held(setup: TuneSetup, rows: list[dict]) -> tuple[int, str]:
    """What the storage holds in the unit the budget counts: the count and its words; a rerun
    with a smaller ``--trials`` (which runs nothing) rewrites the outputs, and they described the
    smaller number as the tune's budget while the tables held more trials."""
    complete = sum(r["state"] == "complete" for r in rows)
    done = complete + sum(r["state"] == "pruned" for r in rows)
    if setup.count == "completed":
        return complete, f"{complete} completed trials ({done} finished or pruned)"
    return done, f"{done} trials finished or pruned ({complete} complete)"


def _budget_text(setup: TuneSetup, rows: list[dict]) -> str:
    held, text = _held(setup, rows)
    if held <= setup.trials:
        return setup.budget_text()
    return (f"{setup.budget_text()} asked by the command that wrote these outputs; the storage holds "
            f"{text}, run by an earlier command with a larger budget")


def _best_recipe(setup: TuneSetup, best, rows: list[dict]) -> str:
    """The recipe with the CLI and space overrides and the best values applied (validated),
    except the short-run settings (:data:`SHORT_RUN_KEYS`), which go back to the recipe's."""
    values = {p.name: p.value_of(best.params) for p in setup.space.params}
    raw = copy.deepcopy(setup.base)
    undone = _undo_short_run_settings(setup, raw)
    apply_overrides(raw, setup.space.overrides_of(values))
    raw.setdefault("train", {})["out_dir"] = str(Path("runs") / f"{setup.study_name}_best")
    raw["name"] = f"{raw.get('name') or setup.recipe.stem}_tuned"
    cfg = config_from_dict(copy.deepcopy(raw))  # runnable: validated as `deepmetric train` will
    del cfg
    head = [f"# {setup.recipe} tuned by `deepmetric tune` ({setup.space_path}, {_held(setup, rows)[1]},",
            f"# study {setup.study_name!r}): trial {best.number}, validation {setup.space.metric} = {best.value:.4f}",
            "# (chosen on validation classes; the test split was not used). Values: "
            + ", ".join(f"{k} = {format_value(v)}" for k, v in values.items())]
    if undone:
        head += ["# The trials were short runs: these overrides of the tune's command / space are NOT in this file",
                 "# (the recipe's own values are): " + ", ".join(undone) + ".",
                 "# The values above were chosen under them; add them to the command to train as the trials did."]
    head.append(f"#   deepmetric train {setup.out / 'best.yaml'}")
    return "\n".join(head) + "\n" + yaml.safe_dump(raw, sort_keys=False, default_flow_style=None)


def _fmt_cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _plots(study, out: Path) -> tuple[dict[str, Path], list[str]]:
    """Optuna's optimisation-history and parameter-importance plots (matplotlib backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import warnings

    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as ovm

    paths, notes = {}, []
    if not any(t.state.name == "COMPLETE" for t in study.get_trials(deepcopy=False)):
        return paths, ["plots: not drawn (no trial has finished yet)"]  # Optuna would only warn
    for name, fn in (("optimization_history", ovm.plot_optimization_history),
                     ("param_importances", ovm.plot_param_importances)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the matplotlib backend is marked experimental
                ax = fn(study)
            fig = ax.figure if hasattr(ax, "figure") else ax[0].figure
            fig.set_size_inches(7, 4.2)
            fig.tight_layout()
            path = out / f"{name}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            paths[name] = path
        except (ValueError, RuntimeError, ZeroDivisionError) as exc:  # e.g. fewer than 2 finished trials
            notes.append(f"{name}: not drawn ({exc})")
    return paths, notes


def write_outputs(setup: TuneSetup) -> dict[str, Path]:
    """(Re)write best.yaml, trials.csv / trials.md, the plots and report.html."""
    study = open_study(setup, create=False)
    out = setup.out
    rows = trial_rows(setup, study)
    paths: dict[str, Path] = {"csv": write_trials_csv(rows, out / "trials.csv")}
    best = _best_trial(setup, study)
    if best is not None:
        rundir.write_text_atomic(out / "best.yaml", _best_recipe(setup, best, rows))
        paths["best"] = out / "best.yaml"
        values = {p.name: p.value_of(best.params) for p in setup.space.params}
        record = {"trial": best.number, "value": best.value, "metric": setup.space.metric,
                  "overrides": setup.space.overrides_of(values)}  # a study's `from_tune: DIR` reads these
        rundir.write_text_atomic(out / "best_overrides.json", json.dumps(record, indent=1) + "\n")
        paths["best_overrides"] = out / "best_overrides.json"
    plots, notes = _plots(study, out)
    paths.update(plots)
    md = _trials_markdown(setup, rows, best, notes)
    rundir.write_text_atomic(out / "trials.md", md)
    paths["md"] = out / "trials.md"
    from deepmetric.report.tune_report import write_tune_report

    paths["report"] = write_tune_report(out / "report.html", title=f"Tune {setup.study_name}",
                                        summary=_summary_pairs(setup, rows, best), rows=rows, plots=plots,
                                        notes=notes)
    return paths


def _summary_pairs(setup: TuneSetup, rows: list[dict], best) -> list[tuple[str, Any]]:
    states: dict[str, int] = {}
    for r in rows:
        states[r["state"]] = states.get(r["state"], 0) + 1
    pairs = [("recipe", str(setup.recipe)), ("space", str(setup.space_path)),
             ("objective", f"validation {setup.space.metric} ({setup.space.direction})"),
             ("budget", _budget_text(setup, rows)),
             ("trials", ", ".join(f"{n} {s}" for s, n in states.items()) or "none yet"),
             ("pruner", setup.space.pruner.get("name", "median")), ("sampler", setup.space.sampler.get("name", "tpe")),
             ("storage", display_storage(setup.storage))]
    if best is not None:
        pairs += [("best trial", f"{best.number}: validation {setup.space.metric} = {best.value:.4f}"),
                  ("best values", ", ".join(f"{p.name} = {format_value(p.value_of(best.params))}"
                                            for p in setup.space.params)),
                  ("best recipe", str(setup.out / "best.yaml"))]
    return pairs


def _trials_markdown(setup: TuneSetup, rows: list[dict], best, notes: list[str]) -> str:
    metric = f"val/{setup.space.metric}"
    params = [p.name for p in setup.space.params]
    cols = ["trial", "state", *params, metric, "pruned_at_epoch", "wall_time_s"]
    lines = [f"# Tune {setup.study_name}", ""]
    lines += [f"- {k}: {v}" for k, v in _summary_pairs(setup, rows, best)]
    lines += ["", "The objective is the validation metric (the best value of the trial, the model best.pt "
              "keeps). The trials never evaluated the test split: no test metric exists to choose on.", "",
              "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt_cell(r.get(c)) for c in cols) + " |")
    lines += [""] + [f"Note: {n}" for n in notes]
    return "\n".join(lines).rstrip() + "\n"
