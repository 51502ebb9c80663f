"""Evaluating a run in training: the in-training :class:`Evaluator` (every ``eval.every``
epochs, the test split every ``eval.test_every``), and after training the test metrics of the
model validation chose (:func:`test_selected`) and WiSE-FT (:func:`wise_ft_after_training`).
The evaluation itself is the run's (:func:`deepmetric.run.evaluation.evaluate_split`)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from deepmetric.run import rundir as R
from deepmetric.run.checkpoint import load_checkpoint, save_checkpoint
from deepmetric.run.config import Config
from deepmetric.run.evaluation import evaluate_split, train_neighbour_metrics
from deepmetric.run.rundir import RunLog

if TYPE_CHECKING:
    from .training_run import TrainingRun

__all__ = ["Evaluator", "eval_due", "check_metric", "wise_ft_after_training", "test_selected"]


def eval_due(cfg: Config, epoch_done: int, total_epochs: int, finished: bool, split: str = "val") -> bool:
    """Whether ``split`` is evaluated after ``epoch_done`` epochs: always at the end, else every
    ``eval.every`` epochs (the test split every ``eval.test_every``, default the same)."""
    if finished or epoch_done == total_epochs:
        return True
    every = cfg.eval.every if split != "test" or cfg.eval.test_every is None else cfg.eval.test_every
    return every > 0 and epoch_done % every == 0


class Evaluator:
    """Evaluate the model on the evaluation splits (``{"val": sets, "test": sets}``, each
    ``{"query": ds}`` or ``{"query": ds, "gallery": ds}``), log and print the metrics
    (rank 0) and share them with every rank.  ``evaluator(epoch, iteration, alphas)``
    returns ``{"val": metrics, "test": metrics}`` (``"val"`` only with a validation split).
    ``splits`` limits one call to some of the splits (``eval.test_every``).  With
    ``eval.cross_domain`` every split also gets the cross-domain metrics (each domain's queries
    against the other domains' images), so validation mirrors a cross-domain test.
    ``on_eval`` sees the test evaluations."""

    def __init__(self, model: nn.Module, losses: nn.ModuleList, eval_sets: dict, cfg: Config, *,
                 device: torch.device, world: int, log: RunLog,
                 on_eval: Callable[[int, dict, dict], None] | None):
        self.model, self.losses, self.eval_sets, self.cfg = model, losses, eval_sets, cfg
        self.device, self.world, self.log, self.on_eval = device, world, log, on_eval

    def __call__(self, epoch: int, iteration: int, alphas: list[float], final: bool = False,
                 splits=None) -> dict[str, dict]:
        results: dict[str, dict] = {}
        ec = self.cfg.eval
        for split, sets in self.eval_sets.items():  # rank 0 holds the evaluation splits
            if splits is not None and split not in splits:
                continue
            t0 = time.perf_counter()
            metrics, embedded = evaluate_split(self.model, sets, self.cfg, device=self.device, losses=self.losses)
            if split == "test" and ec.train_neighbours and final:  # 1 pass over the training set
                metrics.update(train_neighbour_metrics(self.model, embedded, self.cfg, device=self.device))
            rec = {"type": "eval", "split": split, "epoch": epoch, "step": iteration,
                   "eval_seconds": round(time.perf_counter() - t0, 3), **metrics}
            if alphas:
                rec["alpha"] = alphas[0]
            self.log.write(rec)
            shown = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items())
            print(f"[deepmetric] epoch {epoch} step {iteration} {split}: {shown}", flush=True)
            if split == "test" and self.on_eval is not None:
                self.on_eval(epoch, metrics, embedded)
            results[split] = metrics
        if self.world > 1:
            box = [results]
            torch.distributed.broadcast_object_list(box, src=0)
            results = box[0]
        return results


def check_metric(key: str, cfg_key: str, metrics: dict) -> None:
    """A ValueError naming ``cfg_key`` when the evaluation did not give ``key``."""
    if key not in metrics:
        raise ValueError(f"config key '{cfg_key}': {key!r} is not among the evaluated metrics "
                         f"{sorted(metrics)}")


def wise_ft_after_training(run: TrainingRun) -> None:
    """After training (rank 0): WiSE-FT (``eval.wise_ft``) between the model as it started and
    the fine-tuned ``best.pt``; the mixture chosen on validation is written as ``wise.pt``."""
    cfg = run.cfg
    if cfg.eval.wise_ft is None or not run.main:
        return
    from .wise_ft import run_wise_ft

    source = run.out_dir / (R.BEST if (run.out_dir / R.BEST).is_file() else R.LAST)
    best = load_checkpoint(source, map_location=run.device)

    def evaluate(net: nn.Module, split: str) -> dict:
        return evaluate_split(net, run.eval_sets[split], cfg, device=run.device, losses=run.losses)[0]

    res = run_wise_ft(run.model, run.pretrained_state, best["model"], cfg.eval.wise_ft, cfg.eval.wise_ft_params,
                      run.select_key, evaluate, with_test=cfg.eval.test, known=_best_metrics(run, source))
    state = res.pop("state")
    res["finetuned"] = source.name
    keep = ("loss", "alphas", "model_args", "config", "epoch", "iteration")
    save_checkpoint({**{k: best[k] for k in keep if k in best}, "model": state, "wise_ft": _plain_summary(res)},
                    run.out_dir / R.WISE)
    for rec in res["val"]:
        print(f"[deepmetric] WiSE-FT a={rec['alpha']:g} val {run.select_key}={rec[run.select_key]:.4f}", flush=True)
    tested = ("; its test metrics: " + ", ".join(f"{k}={v:.4f}" for k, v in res["test"].items())
              if "test" in res else "")
    print(f"[deepmetric] WiSE-FT: a={res['alpha']:g} chosen on validation {run.select_key} "
          f"({res['value']:.4f}){tested}; written to {run.out_dir / R.WISE}", flush=True)
    run.wise_ft = res


def _best_metrics(run: TrainingRun, source: Path) -> dict:
    """The validation (and test) metrics of ``best.pt`` from this run's log, when best.pt is the
    model of a logged evaluation (its epoch's record): WiSE-FT's a = 1 is that model exactly."""
    epoch = run.state.best.get("epoch")
    if source.name != R.BEST or epoch is None:
        return {}
    out = {}
    for rec in R.read_log(run.out_dir):
        if rec.get("epoch") == epoch and rec.get("type") in ("eval", "selected_eval") and rec.get("split") in ("val", "test"):
            out[rec["split"]] = {k: v for k, v in rec.items()
                                 if k not in ("type", "split", "epoch", "step", "eval_seconds", "alpha")}
    return out


def test_selected(run: TrainingRun) -> None:
    """After training (rank 0), with ``eval.test_selected``: the test metrics of ``best.pt``
    when its epoch's test split was not evaluated (``eval.test_every``), so that ``selected``
    in metrics.json (a study's ``selected/`` columns) always holds the test metrics of the model
    validation chose.  Evaluated on copies: the final model and its loss terms are untouched."""
    import copy

    state, path = run.state, run.out_dir / R.BEST
    if (not run.main or not run.has_val or not run.cfg.eval.test_selected or state.best.get("value") is None
            or state.best.get("test") is not None or not path.is_file() or "test" not in run.eval_sets):
        return
    ckpt = load_checkpoint(path, map_location=run.device)
    model, losses = copy.deepcopy(run.model), copy.deepcopy(run.losses)
    model.load_state_dict(ckpt["model"])
    for loss, saved in zip(losses, ckpt.get("loss", [])):
        loss.load_state_dict(saved)
    t0 = time.perf_counter()
    metrics = evaluate_split(model, run.eval_sets["test"], run.cfg, device=run.device, losses=losses)[0]
    state.best["test"] = metrics
    # its own record type: an "eval" record of an earlier epoch would read as that epoch's evaluation
    run.log.write({"type": "selected_eval", "split": "test", "epoch": state.best["epoch"], "step": state.iteration,
                   "eval_seconds": round(time.perf_counter() - t0, 3), **metrics})
    print(f"[deepmetric] best.pt (epoch {state.best['epoch']}, chosen on validation) test: "
          + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)


def _plain_summary(info: dict) -> dict:
    """The ``wise_ft`` summary as plain floats / strings (a checkpoint entry)."""
    return {k: ([{kk: float(vv) for kk, vv in r.items()} for r in v] if k == "val" else
                {kk: float(vv) for kk, vv in v.items()} if k == "test" else v) for k, v in info.items()}

