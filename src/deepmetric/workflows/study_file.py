"""The study file of ``deepmetric study`` (its format: :mod:`deepmetric.workflows.study`): read,
checked and expanded into one validated run per (benchmark, variant, seed) before any run starts."""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from deepmetric.registry import did_you_mean
from deepmetric.run import rundir
from deepmetric.run.config import ConfigError
from deepmetric.run.config_io import apply_overrides, config_from_dict, read_yaml_mapping

_STUDY_KEYS = ("name", "description", "base", "overrides", "benchmarks", "variants", "seeds",
               "out_dir", "workers", "metrics", "compare", "confidence")


@dataclass
class StudyRun:
    """One training run of a study."""

    key: str                 # "[benchmark/]variant/seed<k>", also its directory under out_dir
    benchmark: str | None
    variant: str
    seed: int
    out_dir: Path
    raw: dict                # the run's config mapping (validated)

    study_dir: Path | None = None   # OUT/.study/<key>: the runner's files of this run
    done_elsewhere: bool = False    # finished by a worker sharing the storage (maybe another machine)
    stored_row: dict | None = None  # that worker's results row

    @property
    def finished(self) -> bool:
        return self.done_elsewhere or (self.out_dir / rundir.METRICS).is_file()

    @property
    def record_dir(self) -> Path:
        return self.study_dir if self.study_dir is not None else self.out_dir


@dataclass
class Study:
    name: str
    path: Path | None
    out_dir: Path
    runs: list[StudyRun]
    variants: list[str]
    benchmarks: list[str | None]
    seeds: list[int]
    workers: int = 1
    metrics: list[str] | None = None
    compare: list[tuple[str, str]] = field(default_factory=list)
    confidence: float = 0.95
    description: str = ""


def _err(where: str, msg: str) -> ConfigError:
    return ConfigError(f"{where}: {msg}")


def _read_yaml(path: Path, where: str) -> dict:
    try:
        return read_yaml_mapping(path)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{where}: {exc}") from None
    except ConfigError as exc:
        raise _err(where, str(exc)) from None


def _resolve_config(value: Any, study_dir: Path, where: str) -> dict:
    """A config given as a path (relative to the study file, else to the working directory)
    or an inline mapping -> a fresh raw mapping."""
    if isinstance(value, dict):
        return copy.deepcopy(value)
    if isinstance(value, str):
        p = Path(value)
        if not p.is_absolute() and (study_dir / p).is_file():
            p = study_dir / p
        return _read_yaml(p, where)
    raise _err(where, f"expected a config file path or a mapping, got {type(value).__name__} {value!r}")


def _tune_overrides(value: Any, study_dir: Path, where: str) -> list[str]:
    """``{from_tune: DIR}``: the best trial's values of the finished tune in ``DIR`` (relative to
    the study file, else to the working directory), as overrides."""
    if not isinstance(value, str):
        raise _err(where, f"from_tune: expected the folder of a finished 'deepmetric tune', got {value!r}")
    d = Path(value)
    if not d.is_absolute() and (study_dir / d).is_dir():
        d = study_dir / d
    path = d / "best_overrides.json"
    if not path.is_file():
        raise _err(where, f"from_tune: {path} not found; run (or finish) 'deepmetric tune ... --out {value}' first "
                          f"(it writes best_overrides.json once a trial has finished)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise _err(where, f"from_tune: {path} is not JSON ({exc}); rewrite it with 'deepmetric tune ... "
                          f"--out {value} --report-only'") from None
    if not isinstance(data, dict) or not isinstance(data.get("overrides"), list):
        raise _err(where, f"from_tune: {path} has no list 'overrides' (the best trial's KEY=VALUE strings); "
                          f"rewrite it with 'deepmetric tune ... --out {value} --report-only'")
    return [str(o) for o in data["overrides"]]


def _override_strings(items: Any, where: str, study_dir: Path = Path(".")) -> list[str]:
    """Overrides as ``key=value`` strings; a one-key mapping ``{key: value}`` is accepted too
    (its value is passed on as JSON, which the override parser reads as YAML), and
    ``{from_tune: DIR}`` stands for the best values of a finished tune."""
    if items is None:
        return []
    if not isinstance(items, list):
        raise _err(where, f"expected a list of overrides, got {type(items).__name__} {items!r}")
    out = []
    tuned: dict[str, str] = {}  # key set by a from_tune -> "item N", the from_tune that set it
    for i, item in enumerate(items):
        if isinstance(item, str):
            if "=" not in item:
                raise _err(f"{where}.{i}", f"expected KEY=VALUE, got {item!r}")
            _keep_tuned(item.split("=", 1)[0].strip(), tuned, f"{where}.{i}")
            out.append(item)
        elif isinstance(item, dict) and list(item) == ["from_tune"]:
            overrides = _tune_overrides(item["from_tune"], study_dir, f"{where}.{i}")
            tuned.update({o.split("=", 1)[0].strip(): f"item {i}" for o in overrides})
            out.extend(overrides)
        elif isinstance(item, dict) and item:
            for k in item:
                _keep_tuned(str(k), tuned, f"{where}.{i}")
            out.extend(f"{k}={json.dumps(v)}" for k, v in item.items())
        else:
            raise _err(f"{where}.{i}", f"expected 'key=value' or {{key: value}}, got {item!r}")
    return out


def _keep_tuned(key: str, tuned: dict[str, str], where: str) -> None:
    """An override that sets a whole mapping or list (``loss=[...]``, ``optim={...}``) after a
    ``from_tune`` would silently replace the tuned values under it (``loss.0.options.margin``):
    refuse, and say how to order them.  Setting a tuned key itself (``optim.lr=...``) is allowed."""
    lost = sorted(t for t in tuned if t.startswith(key + "."))
    if lost:
        raise _err(where, f"'{key}=...' replaces {', '.join(lost)}, which the from_tune of {tuned[lost[0]]} "
                          f"set: the tuned values would be lost. Put from_tune after this override")


def load_study(path: str | os.PathLike | None = None, *, raw: dict | None = None,
               out_dir: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Study:
    """Read and validate a study file (or an already-read mapping ``raw``, relative paths then
    resolved against the working directory).  Every run's config is built and validated here,
    so a mistake in the last variant is reported before the first run starts.  ``overrides``
    (``key=value``) apply to every run after the variant's (smoke tests: ``train.epochs=1``)."""
    study_path = Path(path) if path is not None else None
    where = str(study_path) if study_path is not None else "study"
    if raw is None:
        if study_path is None:
            raise ValueError("load_study: give a path or raw")
        raw = _read_yaml(study_path, "study")
    study_dir = study_path.parent if study_path is not None else Path(".")
    unknown = sorted(set(raw) - set(_STUDY_KEYS))
    if unknown:
        hints = [f"{k!r}{did_you_mean(k, _STUDY_KEYS)}" for k in unknown]
        raise _err(where, f"unknown study key(s) {', '.join(hints)}; valid keys: {', '.join(_STUDY_KEYS)}")
    name = str(raw.get("name") or (study_path.stem if study_path else "study"))
    variants, seeds = _variants(raw, where), _seeds(raw, where)
    common = _override_strings(raw.get("overrides"), f"{where}: overrides")
    benches = _benchmarks(raw, study_dir, where)
    out = Path(out_dir if out_dir is not None else raw.get("out_dir") or f"runs/studies/{name}")
    workers, confidence, metrics = _settings(raw, where)
    compare = _compare(raw, variants, where)
    runs = []
    # the result columns the runs give, collected only to check 'metrics' (a study without it is
    # read as before)
    columns: dict[str, None] | None = {} if metrics is not None else None
    for b, (base_raw, b_over) in benches.items():
        for v, v_items in variants.items():
            v_over = _override_strings(v_items, f"{where}: variants.{v}", study_dir)
            runs.extend(_variant_runs(base_raw, common + b_over + v_over + list(overrides), seeds, out,
                                      benchmark=b, variant=v, where=where, columns=columns))
    if metrics is not None:
        _check_metrics(metrics, list(columns or {}), where)
    return Study(name=name, path=study_path, out_dir=out, runs=runs, variants=list(variants),
                 benchmarks=list(benches), seeds=[int(s) for s in seeds], workers=workers,
                 metrics=metrics, compare=compare, confidence=float(confidence),
                 description=str(raw.get("description") or ""))


def _variants(raw: dict, where: str) -> dict:
    variants = raw.get("variants")
    if not isinstance(variants, dict) or not variants:
        raise _err(where, "'variants' must be a mapping NAME -> list of overrides (at least one)")
    for v in variants:
        check_folder_name(v, "variant", where)
    return variants


def check_folder_name(name, what: str, where: str) -> None:
    """A variant or benchmark name is a folder of the study's runs: one plain name inside OUT
    ('..' put a run outside it, where another run's files would be resumed or counted)."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith("."):
        raise _err(where, f"{what} name {name!r}: expected a non-empty name without '/' or '\\' that does not "
                          "start with '.' (it names a folder of the study's runs)")


def _seeds(raw: dict, where: str) -> list:
    seeds = raw.get("seeds", [0])
    if isinstance(seeds, int):
        seeds = [seeds]
    if (not isinstance(seeds, list) or not seeds or len(set(seeds)) != len(seeds)
            or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds)):
        raise _err(where, f"'seeds': expected a list of distinct ints, got {seeds!r}")
    return seeds


def _benchmarks(raw: dict, study_dir: Path, where: str) -> dict[str | None, tuple[dict, list[str]]]:
    """Benchmark name (None without 'benchmarks') -> (its raw config, its own overrides)."""
    benchmarks_raw = raw.get("benchmarks")
    if benchmarks_raw is None:
        if raw.get("base") is None:
            raise _err(where, "give 'base' (a config path or mapping) or 'benchmarks'")
        return {None: (_resolve_config(raw["base"], study_dir, f"{where}: base"), [])}
    if not isinstance(benchmarks_raw, dict) or not benchmarks_raw:
        raise _err(where, "'benchmarks' must be a mapping NAME -> config (path, mapping or {base, overrides})")
    benches: dict[str | None, tuple[dict, list[str]]] = {}
    for b, spec in benchmarks_raw.items():
        bw = f"{where}: benchmarks.{b}"
        check_folder_name(b, "benchmark", where)
        extra: list[str] = []
        if isinstance(spec, dict) and "base" in spec:
            bad = sorted(set(spec) - {"base", "overrides"})
            if bad:
                raise _err(bw, f"unknown key(s) {bad}; a benchmark is a path, a config mapping or {{base, overrides}}")
            extra = _override_strings(spec.get("overrides"), f"{bw}.overrides")
            spec = spec["base"]
        elif spec is None:
            if raw.get("base") is None:
                raise _err(bw, "no config and no study 'base' to fall back on")
            spec = raw["base"]
        benches[b] = (_resolve_config(spec, study_dir, bw), extra)
    return benches


def _settings(raw: dict, where: str) -> tuple[int, float, list[str] | None]:
    """The study's workers, confidence level and metric columns."""
    workers = raw.get("workers", 1)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise _err(where, f"'workers': expected an int >= 1, got {workers!r}")
    confidence = raw.get("confidence", 0.95)
    if not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
        raise _err(where, f"'confidence': expected a number in (0, 1), got {confidence!r}")
    metrics = raw.get("metrics")
    if metrics is not None and (not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics)):
        raise _err(where, f"'metrics': expected a list of column names, got {metrics!r}")
    return workers, confidence, metrics


def _compare(raw: dict, variants: dict, where: str) -> list[tuple[str, str]]:
    compare = []
    for i, pair in enumerate(raw.get("compare") or []):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise _err(where, f"compare.{i}: expected a pair [A, B] of variant names, got {pair!r}")
        for v in pair:
            if v not in variants:
                raise _err(where, f"compare.{i}: unknown variant {v!r}; variants: {', '.join(variants)}")
        compare.append((pair[0], pair[1]))
    return compare


def _variant_runs(base_raw: dict, overrides: list[str], seeds: list, out: Path, *, benchmark: str | None,
                  variant: str, where: str, columns: dict[str, None] | None = None) -> list[StudyRun]:
    """The runs of one (benchmark, variant), one per seed, each config validated now; with
    ``columns``, the :func:`result_columns` of each run are added to it."""
    runs = []
    for s in seeds:
        key = "/".join(p for p in (benchmark, variant, f"seed{s}") if p is not None)
        run_dir = out / key
        cfg_raw = copy.deepcopy(base_raw)
        try:
            apply_overrides(cfg_raw, overrides)
            apply_overrides(cfg_raw, [f"train.seed={s}", f"train.out_dir={json.dumps(str(run_dir))}"])
            cfg = config_from_dict(copy.deepcopy(cfg_raw))  # validate now
        except ConfigError as exc:
            raise _err(where, f"run {key}: {exc}") from None
        if columns is not None:
            columns.update(dict.fromkeys(result_columns(cfg)))
        runs.append(StudyRun(key, benchmark, variant, int(s), run_dir, cfg_raw, out / ".study" / key))
    return runs


#: the columns :func:`deepmetric.workflows.study.run_row` gives every finished run besides its metrics
RUN_COLUMNS = ("wall_time_s", "images_per_s", "epochs", "steps")


def result_columns(cfg) -> list[str]:
    """The columns a finished run of ``cfg`` can have in the study's results (``study.run_row``):
    ``final/<metric>`` of its final test evaluation; with a validation split ``selected/epoch``
    and ``selected/<metric>`` (the model chosen on it); with ``eval.wise_ft`` ``wise/alpha`` and
    ``wise/<metric>``; then :data:`RUN_COLUMNS`."""
    from deepmetric.run.evaluation import final_test_metrics

    names = final_test_metrics(cfg)
    out = [f"final/{n}" for n in names]
    if cfg.data.has_validation:
        out += ["selected/epoch"] + [f"selected/{n}" for n in names]
    if cfg.eval.wise_ft is not None:
        out += ["wise/alpha"] + [f"wise/{n}" for n in names]
    return out + list(RUN_COLUMNS)


def _check_metrics(metrics: list[str], columns: list[str], where: str) -> None:
    """Every ``metrics`` column is one the study's runs give: a misspelt one ran the whole study
    and showed an empty '-' column for it."""
    unknown = [m for m in metrics if m not in columns]
    if unknown:
        named = ", ".join(f"{m!r}{did_you_mean(m, columns)}" for m in unknown)
        raise _err(where, f"metrics: unknown column(s) {named}; the runs of this study give: {', '.join(columns)}")
