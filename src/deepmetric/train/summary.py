"""What a run prints: a summary before the first step and the result after the last.

Plain functions that return text (the loop prints it), so they are easy to test::

    [deepmetric] run 'own_folder_small_grey' -> runs/my_digits
      data     folder 'my_digits', class_split 'half' (first half of the sorted class names = train)
        train  5 classes, 500 images: eight, five, four, nine, one
        test   5 classes, 500 images: seven, six, three, two, zero
      model    glyph_resnet: 0.31 M parameters, 64-d embedding, input [1, 28, 28]
      loss     1 x heated_softmax
      batches  random, 32 per step; 15 steps/epoch x 5 epochs = 75 steps
      device   cpu, 2 threads, 0 loader workers
      output   runs/my_digits
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from torch import nn

from deepmetric.wording import counted
from ..models import pooling_note
from deepmetric.run import rundir as R
from deepmetric.run.config import Config

__all__ = ["describe_split", "format_run_summary", "format_metrics", "format_baseline", "baseline_verdict",
           "saturation_warning",
           "format_run_end", "count_parameters"]

PREFIX = "[deepmetric]"


def count_parameters(*modules: nn.Module) -> int:
    """Number of parameters of the modules (shared tensors counted once)."""
    seen = set()
    total = 0
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


def _human(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1e6:.2f} M"
    if n >= 1_000:
        return f"{n / 1e3:.1f} k"
    return str(n)


def _class_names(dataset) -> list[str] | None:
    names = dataset.class_names
    if names is None:
        return None
    return [str(n) for n in names]


def describe_split(dataset, max_names: int = 10) -> str:
    """``5 classes, 500 images: eight, five, ...`` (names when the dataset has them)."""
    import numpy as np

    labels = dataset.labels
    n_img = len(dataset)
    n_cls = dataset.num_classes
    if n_cls is None and labels is not None:
        n_cls = len(np.unique(np.asarray(labels)))
    text = f"{n_cls} class{'es' if n_cls != 1 else ''}, {n_img} image{'s' if n_img != 1 else ''}"
    names = _class_names(dataset)
    if names:
        shown = ", ".join(names[:max_names])
        more = f", ... (+{len(names) - max_names} more)" if len(names) > max_names else ""
        text += f": {shown}{more}"
    return text


def _describe_data(cfg: Config) -> str:
    d = cfg.data
    text = d.name + (f" '{d.root}'" if d.root else "")
    cs = d.options.get("class_split")
    if d.val_classes is not None:
        text += f", validation classes carved from train: {d.val_classes}"
    if d.val_query_families:
        text += f" (queried from the held-out families {', '.join(d.val_query_families)})"
    if isinstance(cs, str) and cs == "half":
        text += ", class_split 'half' (first half of the sorted class names = train)"
    elif isinstance(cs, dict):
        text += ", class_split with explicit class lists"
    elif cs is not None:
        text += f", class_split {cs} (random share of the classes, seed {d.options.get('seed', 0)})"
    if d.options.get("split_file"):
        text += f", split_file '{d.options['split_file']}'"
    if d.transform:
        text += f"; transform {d.transform}"
    return text


def _describe_losses(cfg: Config) -> str:
    parts = []
    for t in cfg.loss:
        opts = ", ".join(f"{k}={v}" for k, v in t.options.items())
        w = f"{t.weight:g}"
        parts.append(f"{w} x {t.name}" + (f"({opts})" if opts else "")
                     + (f" on {t.input}" if t.input != "embedding" else ""))
    return " + ".join(parts)


def format_run_summary(cfg: Config, *, train_set, eval_sets: dict[str, Any], model: nn.Module,
                       losses: Sequence[nn.Module] = (), embedding_dim: int | None = None,
                       input_shape: Sequence[int] | None = None, device: Any = "cpu", world: int = 1,
                       threads: int | None = None, steps_per_epoch: int | None = None,
                       total_epochs: int | None = None, total_steps: int | None = None,
                       out_dir: str | Path | None = None, splits: dict[str, Any] | None = None) -> str:
    """The block printed before training: data and split, model, loss, batches, device,
    output directory.  ``eval_sets`` is the loop's ``{"val": {"query": ds}, "test": {"query": ds,
    ...}}`` (or one inner mapping); ``splits`` adds further named splits."""
    t = cfg.train
    lines = [f"{PREFIX} run '{cfg.name}' -> {out_dir if out_dir is not None else t.out_dir}"]
    lines.append(f"  data     {_describe_data(cfg)}")
    from deepmetric.run.evaluation import split_names

    rows = [(cfg.data.train_split, train_set)]
    for name, ds in (splits or {}).items():
        rows.append((name, ds))
    rows += split_names(cfg, eval_sets)
    width = max(len(str(n)) for n, _ in rows)
    for name, ds in rows:
        lines.append(f"    {name:<{width}}  {describe_split(ds)}")
    n_params = count_parameters(model)
    extra = count_parameters(*losses) if losses else 0
    model_line = f"  model    {cfg.model.name}: {_human(n_params)} parameters"
    if extra:
        model_line += f" (+ {_human(extra)} in the loss)"
    if embedding_dim is not None:
        model_line += f", {embedding_dim}-d embedding"
    model_line += pooling_note(model.pool) if model.pool is not None else ""  # None: the model does not pool
    if input_shape is not None:
        model_line += f", input {list(input_shape)}"
    pre = cfg.model.options.get("pretrained")
    model_line += f", pretrained '{pre}'" if pre else ""
    lines.append(model_line)
    lines.append(f"  loss     {_describe_losses(cfg)}")
    if t.sampler == "class_balanced":
        batch = f"class_balanced, {t.m} classes x {t.n} images = {t.m * t.n} per step"
    else:
        batch = f"random, {t.batch_size} per step"
    if world > 1:
        batch += f" per process x {world} processes"
    if steps_per_epoch is not None and total_epochs is not None:
        batch += f"; {counted(steps_per_epoch, 'step')}/epoch x {counted(total_epochs, 'epoch')}"
        if total_steps is not None:
            batch += f" = {counted(total_steps, 'step')}"
    lines.append(f"  batches  {batch}")
    o = cfg.optim
    # every factor that sets a parameter group's lr: a run is read from its banner
    lrs = f", lr {o.lr:g}, weight decay {o.weight_decay:g}"
    if o.new_layer_lr_mult != 1.0:
        lrs += f", new layers x{o.new_layer_lr_mult:g}"
    if o.loss_lr_mult is not None:
        lrs += f", loss parameters x{o.loss_lr_mult:g}"
    if o.layer_decay is not None:
        lrs += f", layer decay {o.layer_decay:g}"
    lines.append(f"  optim    {o.name}{lrs}"
                 + (f", temperature schedule {cfg.schedule.temperature.name}"
                    if cfg.schedule.temperature.name != "none" else ""))
    dev = f"{device}"
    if threads is not None:
        dev += f", {threads} thread{'s' if threads != 1 else ''}"
    nw = cfg.data.num_workers
    dev += f", {nw} loader worker{'s' if nw != 1 else ''}"
    if t.amp != "none":
        dev += f", amp {t.amp}"
    lines.append(f"  device   {dev}")
    lines.append(f"  output   {out_dir if out_dir is not None else t.out_dir}")
    return "\n".join(lines)


def format_metrics(metrics: dict[str, float]) -> str:
    """``recall@1 96.0%, map@r 71.2%, nmi 0.812``: rates as percentages, counts as integers."""
    shown = []
    for k, v in metrics.items():
        if (isinstance(v, int) and not isinstance(v, bool)) or k == "queries_without_positive":
            shown.append(f"{k} {int(v)}")
        elif k in ("nmi",):
            shown.append(f"{k} {v:.3f}")
        else:
            shown.append(f"{k} {100 * v:.1f}%")
    return ", ".join(shown)


def format_baseline(name: str, metrics: dict[str, float] | None, note: str = "") -> str:
    """One line per baseline: ``[deepmetric] baseline raw pixels (28x28x1 = 784-d): ...``."""
    if metrics is None:
        return f"{PREFIX} baseline {name}: skipped ({note})"
    return f"{PREFIX} baseline {name}: {format_metrics(metrics)}"


def baseline_verdict(metrics: dict[str, float], baselines: dict[str, dict] | None, key: str) -> str | None:
    """The warning when a baseline (the untrained network, raw pixels, ...) scores higher than
    the trained embedding on ``key``; None when training beat every baseline (or none was run).
    Printed at the end of a run and kept in ``metrics.json`` ``warnings`` (the report shows it)."""
    beaten_by = [b.get("label", name) for name, b in (baselines or {}).items()
                 if key in (b.get("metrics") or {}) and key in metrics and b["metrics"][key] > metrics[key]]
    if not beaten_by:
        return None
    return (f"the trained embedding ({key} {100 * metrics[key]:.1f}%) is below the baseline of "
            f"{' and '.join(beaten_by)}: training did not help on the test classes (more classes, more "
            "epochs or a different model may)")


def saturation_warning(key: str, value: float, epoch: int, val_classes: int | None) -> str | None:
    """The warning when the selection metric is already at its ceiling (100 %) at the first
    validation evaluation: it cannot rise, so it cannot choose ``best.pt`` (ties keep the
    earliest epoch).  Common with few validation classes."""
    if value < 1.0:
        return None
    few = f", {val_classes} validation classes" if val_classes is not None else ""
    return (f"validation {key} is already 100% at the first evaluation (epoch {epoch}{few}): it cannot improve, "
            f"so it cannot choose best.pt (ties keep the earliest epoch); validate on more classes "
            f"(data.val_classes) or choose by a harder metric (eval.best_metric: map@r)")


def format_run_end(*, metrics: dict[str, float], best: dict[str, Any], seconds: float, epochs: int,
                   steps: int, out_dir: str | Path, baselines: dict[str, dict] | None = None,
                   val_metrics: dict[str, float] | None = None, key: str | None = None,
                   files: Sequence[str] = (R.LAST, R.BEST, R.LOG, R.METRICS)) -> str:
    """The block printed after training: final test (and validation) metrics, the best.pt
    selection, the baselines on ``key`` for comparison, time, and the paths of checkpoint,
    log, metrics and the report command."""
    out = Path(out_dir)
    mins = f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.1f} s"
    lines = [f"{PREFIX} done: {epochs} epochs, {steps} steps in {mins}"]
    if metrics:
        lines.append(f"  final    {format_metrics(metrics)}" + (" (test)" if val_metrics else ""))
    if val_metrics:
        lines.append(f"  final    {format_metrics(val_metrics)} (validation)")
    if best.get("value") is not None:
        lines.append(f"  best     validation {best['metric']} {100 * best['value']:.1f}% at epoch {best['epoch']}"
                     " (best.pt)")
        if best.get("test"):
            lines.append(f"  best     {format_metrics(best['test'])} (test, best.pt)")
    key = key or best.get("metric") or "recall@1"
    for name, b in (baselines or {}).items():
        m = b.get("metrics") or {}
        if key in m:
            lines.append(f"  baseline {b.get('label', name)}: {key} {100 * m[key]:.1f}%")
    verdict = baseline_verdict(metrics, baselines, key)
    if verdict:
        lines.append(f"  warning: {verdict}")
    names = {R.LAST: "checkpoint", R.BEST: "best ckpt", R.LOG: "log", R.METRICS: "metrics"}
    for f in files:
        if (out / f).exists():
            lines.append(f"  {names.get(f, f):<9} {out / f}")
    report = out / "report"
    if report.is_dir():
        lines.append(f"  report    {report}")
    else:
        lines.append(f"  report    deepmetric report {out}")
    return "\n".join(lines)
