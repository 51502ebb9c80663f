"""ALMN's collapse on a short synthetic run: beta 3 with the running-mean centres (with and
without the norm penalty) against the solver-mode centres (issue 21 item 4).

600 steps of a two-layer MLP on Gaussian clusters (100 training classes, 16 x 4 batches,
lr 0.05, momentum 0.9, as the glyph study), 1 thread, about 10 s a run.  For every variant:
the final test Recall@1, the loss, the logged geometry (``rho_median``,
``virtual_past_nn_frac``, ``sample_past_nn_frac``) at steps 1, 100 and 600, and how the
training embeddings ended (median norm, mean cosine between classes: 1 = every sample at one
point).  A collapsed run's loss sits at log 61 = 4.11, a uniform softmax over the 61
candidates of a 16 x 4 batch.

    PYTHONPATH=src .venv/bin/python bench/almn_collapse.py [OUT_DIR]
"""
from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from deepmetric.data.synthetic import GaussianClusters
from deepmetric.run.config_io import config_from_dict
from deepmetric.run.embed import load_model_from_checkpoint
from deepmetric.train.loop import train

DATA = {"num_classes": 100, "per_class": 20, "dim": 32, "noise": 0.15, "seed": 1}
SOLVER = {"centre_mode": "solver"}
#: name: (ALMN options, optim.loss_lr_mult: the centres' lr multiplier in the solver mode)
VARIANTS = {
    "beta3_running_mean": ({"beta": 3.0}, None),
    "beta3_running_mean_lam0": ({"beta": 3.0, "lam": 0.0}, None),
    "beta0_running_mean_lam0": ({"beta": 0.0, "lam": 0.0}, None),
    "beta3_solver_lam0_mult1": ({"beta": 3.0, "lam": 0.0, **SOLVER}, None),
    "beta3_solver_lam0_mult0.02": ({"beta": 3.0, "lam": 0.0, **SOLVER}, 0.02),
    "beta0_solver_lam0_mult0.02": ({"beta": 0.0, "lam": 0.0, **SOLVER}, 0.02),
}


def run(name: str, options: dict, loss_lr_mult: float | None, out: Path) -> dict:
    cfg = config_from_dict({
        "data": {"name": "synthetic", "options": DATA},
        "model": {"name": "synthetic_mlp", "options": {"in_dim": 32, "hidden": 128, "embedding_dim": 32,
                                                       "normalization": "none"}},
        "loss": [{"name": "almn", "options": options}],
        "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0005,
                  "loss_lr_mult": loss_lr_mult},
        "train": {"iterations": 600, "sampler": "class_balanced", "m": 16, "n": 4, "seed": 0,
                  "out_dir": str(out / name), "progress": False, "num_threads": 1},
        "eval": {"every": 0, "metrics": ["recall"], "ks": [1], "baselines": False},
    })
    result = train(cfg, overwrite=True)
    records = [json.loads(line) for line in (out / name / "log.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    model, *_ = load_model_from_checkpoint(out / name / "last.pt")
    model.eval()
    train_set = GaussianClusters("train", **DATA)
    with torch.no_grad():
        emb = model(train_set.x)["embedding"]
    unit = F.normalize(emb, dim=1)
    labels = torch.as_tensor(train_set.labels)
    between = (unit @ unit.t())[labels[:, None] != labels[None]].mean()
    row = {"variant": name, "recall@1": round(result.metrics["recall@1"], 3),
           "median_norm": round(emb.norm(dim=1).median().item(), 3),
           "cos_between_classes": round(between.item(), 3)}
    for i in (0, 99, len(steps) - 1):
        row[f"step{steps[i]['step']}"] = {k.rsplit("/", 1)[-1]: round(v, 3) for k, v in steps[i].items()
                                          if k == "loss" or k.startswith("loss/")}
    return row


def main() -> None:
    torch.set_num_threads(1)
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="almn_collapse_"))
    print(f"# log 61 = {math.log(61):.3f}; runs in {out}")
    for name, (options, mult) in VARIANTS.items():
        print(json.dumps(run(name, options, mult, out)), flush=True)


if __name__ == "__main__":
    main()
