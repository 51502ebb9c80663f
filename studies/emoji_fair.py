"""The fair loss comparison on emoji (issue 21 item 3, the Reality Check protocol): one table of
losses -> one tuning space per loss (``spaces/emoji_fair/<loss>.yaml``) and the study of the
tuned settings over 3 seeds (``studies/emoji_fair.yaml``).  Run ``python studies/emoji_fair.py``
to rewrite them; ``bench/emoji_fair.py`` runs them (tunes, then the study), resumably.

Every loss trains the same network the same way (``recipes/emoji_fair.yaml``: EfficientNet-Lite0
with ImageNet weights, first 5 stages frozen, 64 px, style augmentation, cosine lr, 6 epochs; the
indexed embedding is the backbone's pooled features through a shift-only BN, and the loss reads a
128-d projection head on it), gets the same tuning budget (``TRIALS`` trials finished or pruned,
TPE sampler, median pruner at every epoch) on the same objective (cross-vendor Recall@1 of the
validation emoji: the last 10 % of the training emoji, 96 of the 105 of the category Travel &
Places, a category training hardly sees, as most of the test's are new), over at least its
learning rate, its weight decay and its own main option.  The projection's normalisation and
the batch sampler are each loss's usual ones (the papers').
"""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRIALS = 10
LR = {"type": "float", "low": 1.0e-4, "high": 0.1, "log": True}
WD = {"type": "float", "low": 1.0e-6, "high": 1.0e-2, "log": True}
HEAT = "schedule.temperature={name: heat_up, at: 5, alpha_factor: 0.25, lr_factor: 0.1}"
PAIRS = ["train.sampler=class_balanced", "train.m=16", "train.n=4"]
# ALMN's solver-mode centres start at zero and move at lr x loss_lr_mult, and only when their
# class is in the batch: with 859 training classes and 16 per batch, about 9 times in 6 epochs.
# The first range, 1e-3 to 1, left most candidates with centres that never grew (2026-11-24:
# two complete trials at lr x mult ~ 5e-5 and 1e-5 kept the loss constant, 4.111, for 468 steps, rho
# 0.001: an untrained network); 0.1 to 100 puts about 43 % of the (lr, mult) square in the band
# lr x mult = 0.003-0.1 where the centres reach a useful length.  That alone did not make ALMN
# train: its logits x . c have no temperature, and the unnormalised projection (about 0.3 long)
# or the bn one (BN^ / sqrt(128), about 1 long) kept them near 0.  ALMN therefore reads LONG, the
# bn projection without the 1 / sqrt(dim) (each dim unit variance, about 11 long, no learned
# scale), the analogue of the raw GoogLeNet embedding its paper trains: a 2-epoch check at the
# first trial's values took the loss from 4.11 to 3.45 for beta 3 and beta 0 alike
# (bench/studies/README.md, the ALMN paragraphs).
LONG = {"dim": 128, "norm": "bn", "bn_divide_sqrt_k": False}
CENTRE_LR = {"optim.loss_lr_mult": {"type": "float", "low": 0.1, "high": 100.0, "log": True}}


def _loss(name: str, proj_norm: str | dict, **options) -> list[str]:
    """``proj_norm``: the 128-d projection's norm, or the whole projection mapping (LONG)."""
    term = {"name": name, "input": "projection", "options": options}
    projection = proj_norm if isinstance(proj_norm, dict) else {"dim": 128, "norm": proj_norm}
    return [f"loss={json.dumps([term])}", f"model.options.projection={json.dumps(projection)}"]


def _pml(loss: str, proj_norm: str = "none", **options) -> list[str]:
    return _loss("pml", proj_norm, loss=loss, **options)


#: loss -> (overrides that define it, its own parameters to tune), in the order they are run
LOSSES: dict[str, tuple[list[str], dict]] = {
    "BN": (_loss("heated_softmax", "bn", alpha=16.0),
           {"loss.0.options.alpha": {"type": "categorical", "choices": [8.0, 16.0, 32.0]}}),
    "HBN": (_loss("heated_softmax", "bn", alpha=16.0) + [HEAT],
            {"loss.0.options.alpha": {"type": "categorical", "choices": [8.0, 16.0, 32.0]}}),
    "SM": (_loss("heated_softmax", "none", alpha=1.0, normalize_weights=False), {}),
    "triplet_semihard": (_loss("triplet", "l2", mining="semihard", margin=0.2) + PAIRS,
                         {"loss.0.options.margin": {"type": "float", "low": 0.05, "high": 0.5}}),
    "pml_proxy_anchor": (_pml("ProxyAnchorLoss", margin=0.1, alpha=32),
                         {"loss.0.options.margin": {"type": "float", "low": 0.0, "high": 0.3}}),
    "almn_beta3": (_loss("almn", LONG, beta=3.0, centre_mode="solver") + PAIRS, CENTRE_LR),
    "almn_beta0": (_loss("almn", LONG, beta=0.0, centre_mode="solver") + PAIRS, CENTRE_LR),
    "LN": (_loss("heated_softmax", "l2", alpha=16.0),
           {"loss.0.options.alpha": {"type": "categorical", "choices": [8.0, 16.0, 32.0]}}),
    "HLN": (_loss("heated_softmax", "l2", alpha=16.0) + [HEAT],
            {"loss.0.options.alpha": {"type": "categorical", "choices": [8.0, 16.0, 32.0]}}),
    # N-pair reads the l2 projection (as the Reality Check runs every loss), not its paper's
    # unnormalised embedding: 2-epoch checks at lr 0.0085 (2026-11-24) kept the loss at log 32 on the
    # unnormalised projection (about 0.3 long) and diverged on LONG (loss 25-50, validation 2.5 %),
    # while l2 trained (3.47 -> 2.92, validation 42.3).  On unit vectors its l2 regulariser is a
    # constant, so it is off and N-pair, like SM, tunes only lr and weight decay.
    "npair": (_loss("npair", "l2", l2_reg=0.0) + ["train.sampler=class_balanced", "train.m=32", "train.n=2"], {}),
    "proxy_nca": (_loss("proxy_nca", "none"),
                  {"loss.0.options.scale_x": {"type": "float", "low": 1.0, "high": 32.0, "log": True}}),
    "pml_multi_similarity": (_pml("MultiSimilarityLoss") + PAIRS,
                             {"loss.0.options.base": {"type": "float", "low": 0.3, "high": 0.8}}),
    "pml_normalized_softmax": (_pml("NormalizedSoftmaxLoss"),
                               {"loss.0.options.temperature": {"type": "float", "low": 0.01, "high": 0.2, "log": True}}),
    "pml_arcface": (_pml("ArcFaceLoss"),
                    {"loss.0.options.margin": {"type": "float", "low": 10.0, "high": 40.0}}),
}


def space(name: str) -> dict:
    overrides, own = LOSSES[name]
    return {"objective": {"metric": "cross_domain_recall@1", "direction": "maximize"},
            "params": {"optim.lr": LR, "optim.weight_decay": WD, **own},
            "pruner": {"name": "median"}, "sampler": {"name": "tpe", "seed": 0},
            "overrides": overrides + ["eval.wise_ft=null"]}  # WiSE-FT only in the seeded runs


def main() -> None:
    import yaml

    spaces = ROOT / "spaces" / "emoji_fair"
    spaces.mkdir(parents=True, exist_ok=True)
    head = ("# Generated by studies/emoji_fair.py (the fair emoji loss comparison): do not edit by hand.\n"
            f"#   deepmetric tune recipes/emoji_fair.yaml --space spaces/emoji_fair/NAME.yaml --trials {TRIALS} "
            "--workers 2 --out runs/tune/emoji_fair/NAME\n")
    for name in LOSSES:
        (spaces / f"{name}.yaml").write_text(head + yaml.safe_dump(space(name), sort_keys=False, width=120))
    study = {
        "name": "emoji_fair",
        "description": ("Emoji, styles never seen, every loss tuned the same way (studies/emoji_fair.py): "
                        f"{TRIALS} TPE trials with median pruning on the cross-vendor validation emoji, then 3 seeds "
                        "at the chosen settings; EfficientNet-Lite0, 64 px, pooled-feature embedding, 128-d "
                        "projection head, style augmentation, WiSE-FT chosen on validation."),
        "base": "../recipes/emoji_fair.yaml",
        # from_tune last: the loss's own overrides set whole mappings (loss=[...]), which would
        # replace the tuned loss option if they came after it
        "variants": {name: LOSSES[name][0] + [{"from_tune": f"../runs/tune/emoji_fair/{name}"}] for name in LOSSES},
        "seeds": [0, 1, 2],
        "out_dir": "runs/studies/emoji_fair",
        "workers": 2,
        "metrics": ["final/cross_domain_recall@1", "final/cross_domain_map@r", "selected/cross_domain_recall@1",
                    "selected/cross_domain_map@r", "wise/cross_domain_recall@1", "wise/cross_domain_map@r",
                    "final/recall@1", "final/map@r", "wall_time_s"],
        "compare": [["HBN", "BN"], ["HLN", "LN"], ["BN", "SM"], ["BN", "LN"], ["almn_beta3", "almn_beta0"],
                    ["BN", "triplet_semihard"], ["BN", "pml_proxy_anchor"], ["BN", "pml_multi_similarity"],
                    ["BN", "pml_normalized_softmax"], ["BN", "pml_arcface"]],
    }
    (ROOT / "studies" / "emoji_fair.yaml").write_text(
        "# Generated by studies/emoji_fair.py: do not edit by hand. Needs the tunes of bench/emoji_fair.py first\n"
        "# (each variant takes its tuned values with from_tune).\n" + yaml.safe_dump(study, sort_keys=False, width=120))


if __name__ == "__main__":
    main()
