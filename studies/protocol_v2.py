"""Protocol v2 of the emoji loss comparison (issue 30): the table of losses, the one search-space
*shape* every loss searches, the budgets and seeds, and the comparisons of the summary.
``bench/protocol_v2.py`` runs it; ``python studies/protocol_v2.py [--epochs E] [--out DIR]``
writes each loss's space file (the bench script writes them itself, into its run folder).

Every loss trains ``recipes/protocol_v2.yaml`` (EfficientNet-Lite0, ImageNet weights, first 5
stages frozen, 64 px, style augmentation, cosine lr; the pooled features through a shift-only BN
as the embedding, a 128-d projection head the loss reads; no weight decay on biases,
normalisation layers and loss parameters: ``optim.decay_exclude``), and searches:

* the optimiser, ``sgd`` (momentum 0.9) or ``adamw``;
* the learning rate, log-uniform over ``LR`` (one range wide enough for both optimisers);
* the weight decay, log-uniform over ``WD`` (on the weights that take it, see above);
* the lr multiplier of the new layers (embedding BN, projection) and of the loss's parameters
  (proxies, class weights), one of ``MULTS``;
* which embedding is indexed, validated and selected on: ``embedding`` (the pooled backbone
  features through the shift-only BN: "pooled") or ``projection`` (the loss's own output: "own");
* the loss's own main option(s), as in the fair comparison (``studies/emoji_fair.py``).

Same TPE sampler (seed ``SAMPLER_SEED``) for every loss; a median pruner that acts only from the
second half of training (``n_warmup_steps = max(epochs // 2, 2)``: never before epoch 2) and
after ``PRUNER_STARTUP`` complete trials; every loss gets exactly ``TRIALS`` *completed* trials
(pruned and failed ones do not count; at most ``MAX_TRIALS_FACTOR x TRIALS`` trials in all, and
a loss that hits the cap is reported with fewer).  Tune trials train with ``train.seed`` 0 and
never evaluate the test split; the verdict comes from runs on seeds no tune used (``SEEDS``,
``CLAIM_SEEDS`` for the paper claims' losses), evaluated on test by one final step.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("emoji_fair_table", ROOT / "studies" / "emoji_fair.py")
fair = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fair)

#: epochs of every tune trial and seeded run (the pre-registration fixes it; --epochs overrides)
EPOCHS = 10
#: completed trials per loss, and the cap on all trials (finished or pruned) as a multiple of it
TRIALS = 12
MAX_TRIALS_FACTOR = 3
SAMPLER_SEED = 0
PRUNER_STARTUP = 4
#: trials at a time in every tune, on any machine (pre-registered: TPE then sees the same number of
#: finished trials when it samples, whichever machine runs a loss)
TUNE_WORKERS = 4
OBJECTIVE = "cross_domain_recall@1"
#: the tunes train with train.seed TUNE_SEED; the seeded runs use seeds no tune used
TUNE_SEED = 0
SEEDS = [100, 101, 102]
CLAIM_SEEDS = [100, 101, 102, 103, 104]
#: the pre-registered hypotheses on the primary metric (A - B, paired by seed), Holm-corrected
#: together with H5a / H5b (bench/two_head_accuracy.py's two_head_accuracy.csv, when it exists)
#: and H6 (the best of OURS against the best of PML, each by its tune's validation objective)
COMPARISONS = [("H1", "HBN", "BN"), ("H2", "BN", "SM"), ("H3", "HLN", "LN"), ("H4", "almn_beta3", "almn_beta0")]
TWO_HEAD = [("H5a", "semihard", "softmax"), ("H5b", "hard", "softmax")]
#: the losses of the paper claims (PREREGISTRATION.md: seeds 103, 104 too): those of H1-H4, the
#: claims this script tests (H5 is bench/two_head_accuracy.py's; N-pair and triplet semi-hard are in
#: no hypothesis, so they get the ranked table's 3 seeds like every other loss)
CLAIM_LOSSES = list(dict.fromkeys(n for _, a, b in COMPARISONS for n in (a, b)))
#: The secondary glyph analysis (PREREGISTRATION.md: "if compute allows"): the heated-up variants on
#: the glyph cross-family benchmark at v1's glyph settings (the base of studies/glyphs_cross_family.yaml:
#: compact ResNet from scratch, 32 px, SGD lr 0.05, constant lr), 20 epochs, heating at epoch 16,
#: validation on the carved-out characters only (best.pt on validation Recall@1), seeds 100-104
GLYPH_STUDY = "studies/glyphs_cross_family.yaml"
GLYPH_EPOCHS = 20
GLYPH_HEAT = "schedule.temperature={name: heat_up, at: 16, alpha_factor: 0.25, lr_factor: 0.1}"
GLYPH_OVERRIDES = [f"train.epochs={GLYPH_EPOCHS}", "eval.every=1", "eval.test=false", "eval.test_selected=false",
                   "eval.best_metric=recall@1", "eval.baselines=false",
                   "eval.metrics=[recall, map@r]"]  # the analysis' two metrics: no k-means over 63,155 test glyphs
GLYPH_VARIANTS = {
    "HBN": [GLYPH_HEAT],
    "BN": ["schedule.temperature.name=none", "loss.0.options.alpha=16"],
    "SM": ["model.options.norm=none", "loss.0.options.alpha=1.0", "loss.0.options.normalize_weights=false",
           "schedule.temperature.name=none"],
    "LN": ["model.options.norm=l2", "schedule.temperature.name=none"],
    "HLN": ["model.options.norm=l2", GLYPH_HEAT],
}
GLYPH_COMPARISONS = [("HBN", "BN"), ("BN", "SM"), ("HLN", "LN")]

#: the pre-registered family (PREREGISTRATION.md, "Hypotheses"): id -> (claim, paper)
HYPOTHESES = {
    "H1": ("HBN > BN (heating-up beats the fixed alpha 16)", "heated-up softmax, Tables 1-2"),
    "H2": ("BN > SM (the normalised embedding beats plain softmax)", "heated-up softmax, Tables 1-2"),
    "H3": ("HLN > LN (heating-up helps the l2 embedding too)", "heated-up softmax, Tables 1-2"),
    "H4": ("ALMN beta 3 > ALMN beta 0 (the adaptive angular margin), solver-mode centres", "ALMN, Table 2"),
    "H5a": ("two-head softmax + semi-hard triplet > softmax, closed-set top-1", "two-head, Tables 1-2"),
    "H5b": ("two-head softmax + hard triplet > softmax, closed-set top-1", "two-head, Tables 1-2"),
    "H6": ("the best of our losses > the best pytorch-metric-learning loss (each by its tuned validation "
           "objective)", "not a paper claim: the user's question"),
}
OURS = ["HBN", "BN", "SM", "LN", "HLN", "almn_beta3", "almn_beta0", "npair", "triplet_semihard"]
PML = ["pml_proxy_anchor", "pml_multi_similarity", "pml_arcface", "pml_normalized_softmax"]
#: the decision rule: the smallest difference (points of the primary metric) called a gain
MIN_GAIN_POINTS = 1.0
ALPHA = 0.05


def control_beyond_own_runs(control: list[dict], own: dict[str, list[float]]) -> tuple[list[str], list[str], list[str]]:
    """The control's reading (PREREGISTRATION.md, 2026-11-28, twelfth session, corrections 1): a
    loss's one control run (``control.csv`` rows, values as text) did better at the winner's settings
    only when it lies above every one of its own seeded runs (``own``: loss -> validation values at
    best.pt), worse only when below every one. Returns the losses (above, below, within); a loss
    whose run is the winner's own training, or without a value or own runs, is in none."""
    above, below, within = [], [], []
    for r in control:
        mine, value = own.get(r["loss"]), r.get("val_at_winner_settings")
        if r.get("same_run") == "True" or not mine or value in ("", None):
            continue
        side = above if float(value) > max(mine) else below if float(value) < min(mine) else within
        side.append(r["loss"])
    return above, below, within
#: ALMN's beta sweep at almn_beta3's tuned settings
BETAS = [0.0, 1.0, 2.0, 3.0]
BETA_SEEDS = [100, 101, 102, 103, 104]
#: ALMN's secondary analyses (PREREGISTRATION.md) at the sweep's best beta, chosen on validation:
#: the batch's m x n (classes x images per class, batch 64; 16 x 4, the sweep's own, is the
#: reference) and Eq. 12's ablation (a fixed L-Softmax-like margin, m = 2, for the virtual point)
ALMN_MORE = {"m32_n2": ["train.m=32", "train.n=2"], "m8_n8": ["train.m=8", "train.n=8"],
             "eq12_fixed_margin": ["loss.0.options.margin_mode=fixed"]}

LR = {"type": "float", "low": 1.0e-5, "high": 0.1, "log": True}
WD = {"type": "float", "low": 1.0e-6, "high": 0.1, "log": True}
MULTS = [1.0, 10.0, 100.0]
#: the config keys of the shared dimensions (the control phase runs every loss at the winner's)
SHARED = {
    "optim.name": {"type": "categorical", "choices": ["sgd", "adamw"]},
    "optim.lr": LR,
    "optim.weight_decay": WD,
    "optim.new_layer_lr_mult": {"type": "categorical", "choices": MULTS},
    "eval.embedding": {"type": "categorical", "choices": ["embedding", "projection"]},
}
EMBEDDING_NAMES = {"embedding": "pooled", "projection": "own"}


def _contrastive() -> tuple[list[str], dict]:
    """Contrastive loss (Hadsell et al. 2006) as pytorch-metric-learning writes it, with both
    margins (positive pairs pulled within pos_margin, negatives pushed beyond neg_margin, on the
    l2-normalised projection, distances in [0, 2]), m x n batches; its own options: both margins."""
    return (fair._pml("ContrastiveLoss", "l2", pos_margin=0.0, neg_margin=1.0) + fair.PAIRS,
            {"loss.0.options.pos_margin": {"type": "float", "low": 0.0, "high": 0.5},
             "loss.0.options.neg_margin": {"type": "float", "low": 0.5, "high": 1.5}})


def _table() -> dict[str, tuple[list[str], dict]]:
    order = ["HBN", "BN", "SM", "LN", "HLN", "almn_beta3", "almn_beta0", "npair", "triplet_semihard",
             "pml_proxy_anchor", "pml_multi_similarity", "pml_arcface", "pml_normalized_softmax", "proxy_nca"]
    table = {name: copy.deepcopy(fair.LOSSES[name]) for name in order}
    table["contrastive"] = _contrastive()
    return table


#: loss -> (overrides that define it, its own options to search), in the order they are run;
#: the heated-up variants' HEAT is placed by :func:`overrides` (the last fifth of the epochs)
LOSSES: dict[str, tuple[list[str], dict]] = _table()


def heat_at(epochs: int) -> int:
    """The epoch the heated-up variants heat at: the start of the last fifth of the schedule."""
    return max(1, epochs - max(1, epochs // 5))


def overrides(name: str, epochs: int = EPOCHS) -> list[str]:
    """The overrides that define loss ``name``, heating moved to the last fifth of ``epochs``."""
    out = []
    for o in LOSSES[name][0]:
        if o == fair.HEAT:
            o = f"schedule.temperature={{name: heat_up, at: {heat_at(epochs)}, alpha_factor: 0.25, lr_factor: 0.1}}"
        out.append(o)
    return out


def space(name: str, epochs: int = EPOCHS) -> dict:
    """Loss ``name``'s search space: the shared dimensions and its own options."""
    own = LOSSES[name][1]
    clash = set(own) & set(SHARED)
    if clash:
        raise ValueError(f"{name}: its own options {sorted(clash)} are shared dimensions")
    return {"objective": {"metric": OBJECTIVE, "direction": "maximize"},
            "params": {**copy.deepcopy(SHARED), **copy.deepcopy(own)},
            "pruner": {"name": "median", "n_startup_trials": PRUNER_STARTUP, "n_warmup_steps": max(epochs // 2, 2)},
            "sampler": {"name": "tpe", "seed": SAMPLER_SEED},
            "overrides": overrides(name, epochs)}


def seeds_of(name: str) -> list[int]:
    return list(CLAIM_SEEDS if name in CLAIM_LOSSES else SEEDS)


def write_spaces(out: Path, epochs: int = EPOCHS) -> dict[str, Path]:
    import yaml

    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in LOSSES:
        path = out / f"{name}.yaml"
        head = (f"# Generated by studies/protocol_v2.py ({epochs} epochs): do not edit by hand.\n")
        text = head + yaml.safe_dump(space(name, epochs), sort_keys=False, width=120)
        if not path.is_file() or path.read_text() != text:  # unchanged files keep their time stamps
            path.write_text(text)
        paths[name] = path
    return paths


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="write protocol v2's space files")
    ap.add_argument("--epochs", type=int, default=EPOCHS)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "protocol_v2" / "spaces")
    args = ap.parse_args(argv)
    for name, path in write_spaces(args.out, args.epochs).items():
        print(f"{name:<24} {path}")
    print(json.dumps({"losses": list(LOSSES), "trials": TRIALS, "epochs": args.epochs}))


if __name__ == "__main__":
    main()
