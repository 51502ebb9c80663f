"""recipes/: every paper-table recipe validates with the training config loader, names only
models / losses / transforms / dataset splits that exist with options they accept, follows
the papers' hyper-parameters, and equals the output of recipes/generate.py."""
import json
import importlib.util
import re
from pathlib import Path

import pytest
import torch
import yaml

from deepmetric.run.config_io import load_config

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p for p in (ROOT / "recipes").rglob("*.yaml"))
# the emoji closed-set recipes in two_head/ test a paper claim on our benchmark: hand-written, not
# a paper table row (test_emoji_closed_set_recipes)
PAPER_RECIPES = [p for p in RECIPES if p.parent.name in ("heated", "almn", "two_head", "two_head_hdd")
                 and not p.name.startswith("emoji_closed_set_")]


def _rel(p):
    return str(p.relative_to(ROOT / "recipes"))


def _generator():
    spec = importlib.util.spec_from_file_location("recipes_generate", ROOT / "recipes" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def configs():
    return {_rel(p): load_config(p) for p in RECIPES}


@pytest.mark.parametrize("path", RECIPES, ids=_rel)
def test_every_recipe_validates(path):
    cfg = load_config(path)
    assert cfg.name and cfg.description
    if path in PAPER_RECIPES:
        head = path.read_text().splitlines()[:3]
        assert head[0].startswith("# ") and head[1].startswith(("# Table", "# Figure"))
        assert head[2].startswith("# published: ")
        if head[1].startswith("# Table"):  # figures (curves) have no published numbers
            assert re.search(r"\d+\.\d+", head[2])
        assert cfg.train.out_dir.endswith(cfg.name)


def test_generator_output_equals_committed_files():
    gen = _generator()
    files = gen.outputs()
    yaml_files = {p for p in files if p.suffix == ".yaml"}
    assert yaml_files == set(PAPER_RECIPES), "run: python recipes/generate.py"
    for p, text in files.items():
        assert p.read_text(encoding="utf-8") == text, f"{p} is stale: run python recipes/generate.py"
    assert gen.main(["--check"]) == 0


def test_recipe_set_covers_the_paper_tables():
    names = {_rel(p) for p in PAPER_RECIPES}

    def count(prefix):
        return sum(1 for n in names if n.startswith(prefix))

    # heated-up: Table 1 (3 datasets x 5 models), Table 2 (In-shop x 5), Table 3 (3 dims x 7
    # columns), Table 4 (classification: 2 datasets x 5 models), Table 5 (6 inits x
    # with/without heat-up), Table 6 (SM + 3 x 3), Table 7 (training accuracy, 5 alphas)
    assert (count("heated/table1_"), count("heated/table2_"), count("heated/table3_"), count("heated/table4_"),
            count("heated/table5_"), count("heated/table6_"), count("heated/table7_")) == (15, 5, 21, 10, 12, 10, 5)
    # ALMN: Table 1 (2 x 4 m x n), Table 2 (2 x 4 betas), Table 3 (2 x 4), Table 4 (SOP x 2),
    # the Eq. 12 ablation of Fig. 4 (Eq. 12 m = 2 and Eq. 8 beta = 2 on CUB)
    assert (count("almn/table1_"), count("almn/table2_"), count("almn/table3_"),
            count("almn/table4_"), count("almn/fig4_")) == (8, 8, 8, 2, 2)
    # two-head: 3 architectures x 5 datasets x 4 methods
    assert count("two_head/") == 60
    for arch in ("resnet50", "inception_v4", "densenet161"):
        for ds in ("cars196", "flowers102", "dogs", "aircraft", "nabirds"):
            for method in ("softmax", "center", "semihard", "hard"):
                assert f"two_head/{arch}_{ds}_{method}.yaml" in names


# --------------------------------------------------------------------------- names and options
def test_names_and_options_exist(configs):
    from deepmetric.data import build_transform
    from deepmetric.data.benchmarks import BENCHMARKS
    from deepmetric.losses import build_loss, list_losses
    from deepmetric.models import create_model, is_timm_name, list_models

    seen_models, seen_losses, seen_tf = set(), set(), set()
    for name, cfg in configs.items():
        d = cfg.data
        if d.name in BENCHMARKS:
            _, protocols, default = BENCHMARKS[d.name]
            splits = protocols[d.options.get("protocol", default)]
            for split in (d.train_split, cfg.eval.split, cfg.eval.gallery_split):
                assert split is None or split in splits, f"{name}: split {split!r} not in {splits}"
        assert cfg.model.name in list_models() or is_timm_name(cfg.model.name), name
        opts = {k: v for k, v in cfg.model.options.items() if k != "pretrained"}
        key = (cfg.model.name, json.dumps(opts, sort_keys=True))  # options may hold mappings (projection)
        if key not in seen_models:  # build on the meta device: checks every option, no memory
            seen_models.add(key)
            extra = {"num_classes": 10} if cfg.model.name == "two_head" else {}
            with torch.device("meta"):
                model = create_model(cfg.model.name, **opts, **extra)
            if opts.get("embedding_head", True):  # embedding_dim 0: the pooled features themselves
                assert model.embedding_dim == (opts["embedding_dim"] or model.num_features), name
        for t in cfg.loss:
            assert t.name in list_losses(), name
            k = (t.name, json.dumps(t.options, sort_keys=True))
            if k not in seen_losses:
                seen_losses.add(k)
                auto = {"num_classes": 10, "embedding_dim": 16} if t.name in ("heated_softmax", "almn", "center") else {}
                build_loss(t.name, **auto, **t.options)
        if d.transform is not None:
            k = (d.transform, json.dumps(d.transform_options, sort_keys=True))
            if k not in seen_tf:
                seen_tf.add(k)
                build_transform(d.transform, train=True, **d.transform_options)
                build_transform(d.transform, train=False, **d.transform_options)
    assert len(seen_models) >= 5 and len(seen_losses) >= 8


# --------------------------------------------------------------------------- hyper-parameters
def _by_prefix(configs, prefix):
    return {n: c for n, c in configs.items() if n.startswith(prefix)}


def test_heated_up_hyper_parameters(configs):
    """REFERENCE.md section 1 / heated-up paper Sec. 5.1."""
    heated = _by_prefix(configs, "heated/")
    assert len(heated) == 78
    for name, c in heated.items():
        assert c.model.name == "googlenet" and c.train.batch_size == 32 and c.train.sampler == "random"
        assert c.data.transform_options == {"resize": 256, "crop": 224}
        (term,) = c.loss
        assert term.name == "heated_softmax"
        if "_sop_" in name:
            assert (c.optim.name, c.optim.lr, c.optim.eps) == ("adam", 0.01, 0.01)
        else:
            assert (c.optim.name, c.optim.lr, c.optim.momentum) == ("sgd", 0.004, 0.9)
        t = c.schedule.temperature
        heated_run = name.endswith(("_hbn.yaml", "_hln.yaml", "_heated.yaml"))
        if heated_run:
            assert (t.name, t.at, t.alpha_factor, t.lr_factor, c.train.epochs) == ("heat_up", 60, 0.25, 0.1, 80)
        else:
            assert t.name == "none"
        norm, alpha = c.model.options["norm"], term.options["alpha"]
        if name.endswith("_sm.yaml"):  # off-the-shelf softmax: nothing normalised, alpha 1
            assert (norm, alpha, term.options["normalize_weights"]) == ("none", 1.0, False)
    t1 = heated["heated/table1_cars196_hbn.yaml"]
    assert (t1.model.options["norm"], t1.model.options["embedding_dim"], t1.loss[0].options["alpha"]) == ("bn", 64, 16.0)
    assert heated["heated/table1_cub_hln.yaml"].model.options["norm"] == "l2"
    inshop = heated["heated/table2_inshop_hbn.yaml"].eval
    assert (inshop.split, inshop.gallery_split, inshop.ks) == ("query", "gallery", [1, 10, 20, 30])
    assert heated["heated/table3_cars196_d256_alpha32.yaml"].model.options["embedding_dim"] == 256
    assert heated["heated/table3_cars196_d256_alpha32.yaml"].loss[0].options["alpha"] == 32.0
    assert heated["heated/table5_cars196_learned_alpha8_heated.yaml"].loss[0].options == {
        "alpha": 8.0, "learnable_alpha": True}
    wo = heated["heated/table6_cars196_bn_wo_wn_alpha16.yaml"]
    assert (wo.model.options["norm"], wo.loss[0].options) == ("bn", {"alpha": 16.0, "normalize_weights": False})
    # Table 4: same classes in train and test (classification protocol), classifier accuracy
    for ds in ("cars196", "cub"):
        for model in ("sm", "ln", "bn", "hln", "hbn"):
            c = heated[f"heated/table4_{ds}_{model}.yaml"]
            assert c.data.options["protocol"] == "classification"
            # the final model is reported (no test-set selection: no best_metric without val classes)
            assert (c.eval.split, c.eval.classification, c.eval.best_metric) == ("test", True, None)
    assert heated["heated/table4_cub_hln.yaml"].schedule.temperature.name == "heat_up"
    # Table 7: final training accuracy of BN models at five fixed alphas
    for a in (2, 4, 8, 16, 32):
        c = heated[f"heated/table7_cars196_alpha{a}.yaml"]
        assert (c.loss[0].options["alpha"], c.model.options["norm"]) == (float(a), "bn")
        assert (c.eval.split, c.eval.classification, c.schedule.temperature.name) == ("train", True, "none")


def test_almn_hyper_parameters(configs):
    """REFERENCE.md section 2 / ALMN paper Sec. 5.1."""
    almn = _by_prefix(configs, "almn/")
    for name, c in almn.items():
        assert c.model.name == "googlenet"
        assert (c.model.options["embedding_dim"], c.model.options["dropout"]) == (512, 0.2)
        assert c.data.transform_options == {"resize": 256, "crop": 227}
        assert (c.optim.lr, c.optim.momentum, c.optim.weight_decay, c.optim.new_layer_lr_mult) == (1e-5, 0.9, 2e-4, 10.0)
        lr = c.schedule.lr
        assert (lr.name, lr.unit, lr.milestones, lr.gamma) == ("multistep", "iteration", [20000], 0.8)
        assert c.train.iterations == (80_000 if "_cars196_" in name else 50_000)
        assert c.train.sampler == "class_balanced" and c.train.m * c.train.n == c.train.batch_size
        assert c.train.class_sampling == "uniform"  # "the classes and samples are all randomly selected"
        assert c.loss[0].name == "almn" and c.loss[0].options["lam"] == 0.0005
    assert [(c.train.m, c.train.n) for n, c in sorted(almn.items()) if n.startswith("almn/table1_cub")] == [
        (16, 8), (26, 5), (65, 2), (8, 16)]
    for beta in range(4):
        c = almn[f"almn/table3_aircraft_beta{beta}.yaml"]
        assert c.loss[0].options["beta"] == beta and (c.train.m, c.train.n) == (26, 5)
    eq12 = almn["almn/fig4_cub_eq12_m2.yaml"].loss[0].options
    assert (eq12["margin_mode"], eq12["margin_m"]) == ("fixed", 2)
    assert almn["almn/fig4_cub_eq8_beta2.yaml"].loss[0].options["beta"] == 2.0


def test_two_head_hyper_parameters(configs):
    """REFERENCE.md section 3 / two-head paper Sec. 4.1."""
    th = {n: c for n, c in _by_prefix(configs, "two_head/").items() if not n.startswith("two_head/emoji_closed_set_")}
    for name, c in th.items():
        arch = c.model.options["backbone"]
        assert c.model.name == "two_head" and arch in name
        if name.endswith("_softmax.yaml"):  # single head: no untrained embedding head
            assert c.model.options["embedding_head"] is False and "embedding_dim" not in c.model.options
        else:
            assert (c.model.options["embedding_dim"], c.model.options["norm"]) == (256, "l2")
        assert (c.train.m, c.train.n, c.train.batch_size, c.train.class_sampling) == (8, 4, 32, "uniform")
        assert c.train.iterations == (80_000 if arch == "inception_v4" else 40_000)
        assert (c.optim.name, c.optim.lr, c.optim.momentum) == ("sgd", 0.01, 0.9)
        assert (c.schedule.lr.name, c.schedule.lr.power, c.schedule.lr.end_factor) == ("poly", 1.0, 0.0)
        assert c.data.options["protocol"] == "classification" and c.eval.classification
        ce, *reg = c.loss
        assert (ce.name, ce.input) == ("cross_entropy", "logits")
        method = name.rsplit("_", 1)[1][:-5]
        if method == "softmax":
            assert reg == []
        else:
            (r,) = reg
            assert r.input == "embedding"
            want = {"center": ("center", 0.003, {"rate": 0.5}),
                    "semihard": ("triplet", 1.0, {"mining": "semihard", "margin": 0.2}),
                    "hard": ("triplet", 1.0, {"mining": "hard", "soft_margin": True})}[method]
            assert (r.name, r.weight, r.options) == want


def test_emoji_closed_set_recipes(configs):
    """Issue 30 item 5: the three variants differ only in the loss (and the softmax baseline's
    missing embedding head); closed-set vendor split tested on twitter, classifier accuracy only."""
    cs = {v: configs[f"two_head/emoji_closed_set_{v}.yaml"] for v in ("softmax", "semihard", "hard")}
    for v, c in cs.items():
        assert c.data.options == {"protocol": "closed_set_vendor", "test_vendor": "twitter", "val_vendor": None,
                                  "size": 64}
        o = c.model.options
        assert (c.model.name, o["backbone"], o["pretrained"], o["input_size"]) == ("two_head", "efficientnet_lite0",
                                                                                   "imagenet", 64)
        assert o.get("embedding_head", True) is (v != "softmax")
        assert (c.train.sampler, c.train.m, c.train.n, c.train.epochs) == ("class_balanced", 16, 4, 15)
        assert c.train.channels_last is True  # 1.6x on the CPU, same mathematics (bench/cpu_channels_last.py)
        assert (c.eval.split, c.eval.every, c.eval.classification, c.eval.metrics) == ("test", 0, True, [])
        assert [(t.name, t.input, t.weight) for t in c.loss][0] == ("cross_entropy", "logits", 1.0)
    assert [len(c.loss) for c in cs.values()] == [1, 2, 2]
    assert cs["semihard"].loss[1].options == {"mining": "semihard", "margin": 0.2}
    assert cs["hard"].loss[1].options == {"mining": "hard", "soft_margin": True}
    strip = ("name", "description", "model", "loss", "train")
    for c in cs.values():  # everything else is the same
        a, b = c.__dict__, cs["softmax"].__dict__
        assert {k: a[k] for k in a if k not in strip} == {k: b[k] for k in b if k not in strip}
        assert {**c.train.__dict__, "out_dir": ""} == {**cs["softmax"].train.__dict__, "out_dir": ""}


def test_two_head_hdd_hyper_parameters(configs):
    """Two-head paper Sec. 4.2 / Table 3: SOD input, random-init 5-channel ResNet-50, 10k
    iterations, batch 33 / 63, softmax vs semi-hard; class-balanced variants as an option."""
    hdd = _by_prefix(configs, "two_head_hdd/")
    assert sorted(hdd) == sorted(f"two_head_hdd/table3_b{b}_{m}{s}.yaml" for b in (33, 63)
                                 for m in ("softmax", "semihard") for s in ("", "_balanced"))
    for name, c in hdd.items():
        assert c.data.name == "hdd" and c.data.transform == "sod" and c.data.transform_options["scale"] == 1.0
        assert (c.data.options["rate"], c.data.options["window"], c.data.options["min_seconds"]) == (3.0, 6, 2.0)
        o = c.model.options
        assert (c.model.name, o["backbone"], o["in_chans"], o.get("pretrained")) == ("two_head", "resnet50", 5, None)
        assert c.train.iterations == 10_000 and (c.optim.lr, c.schedule.lr.name) == (0.01, "poly")
        assert c.train.batch_size == (33 if "_b33_" in name else 63)
        if name.endswith("_balanced.yaml"):
            assert c.train.sampler == "class_balanced" and c.train.m * c.train.n == c.train.batch_size
        else:
            assert c.train.sampler == "random"
        assert c.eval.every == 0 and c.eval.classification and c.eval.best_metric is None  # final model, no test-set selection
        assert len(c.loss) == (2 if "_semihard" in name else 1)
        if "_softmax" in name:  # single head: no untrained embedding head, as the fine-grained ones
            assert o["embedding_head"] is False and "embedding_dim" not in o and "norm" not in o
        else:
            assert (o["embedding_dim"], o["norm"]) == (256, "l2")
    assert "macro acc. 53.70" in (ROOT / "recipes" / "two_head_hdd" / "table3_b33_semihard.yaml").read_text().splitlines()[2]


def test_headers_carry_published_numbers():
    """Spot checks against the papers' tables (REFERENCE.md section 6)."""
    def head(rel):
        return (ROOT / "recipes" / rel).read_text().splitlines()[2]

    assert "NMI 68.10" in head("heated/table1_cars196_hbn.yaml") and "R@1 74.70" in head("heated/table1_cars196_hbn.yaml")
    assert "R@1 50.68" in head("heated/table1_cub_hbn.yaml")
    assert "R@1 72.04" in head("heated/table1_sop_hbn.yaml")
    assert "R@1 81.1" in head("heated/table2_inshop_hbn.yaml")
    assert "R@1 80.1" in head("heated/table3_cars196_d256_hbn.yaml")
    assert "R@1 52.4" in head("almn/table2_cub_beta3.yaml") and "R@1 71.6" in head("almn/table2_cars196_beta3.yaml")
    assert "R@1 69.9" in head("almn/table4_sop_beta3.yaml")
    assert "R@1 90.1" in head("almn/table3_flowers102_beta3.yaml") and "R@1 68.4" in head("almn/table3_aircraft_beta3.yaml")
    assert "top-1 86.61" in head("two_head/resnet50_flowers102_hard.yaml")
    assert "R@1 90.40" in head("two_head/resnet50_flowers102_hard.yaml")


# --------------------------------------------------------------------------- smoke runs
SYNTH = ["data.name=synthetic", "data.root=null", "data.options={num_classes: 6, per_class: 8, dim: 12}",
         "data.transform=null", "data.transform_options={}", "data.num_workers=0",
         "train.progress=false", "train.device=cpu"]


@pytest.mark.parametrize("recipe, overrides", [
    ("heated/table5_cars196_learned_alpha8_heated.yaml",
     ["model.name=synthetic_mlp", "model.options={in_dim: 12, embedding_dim: 8}",
      "train.epochs=2", "train.batch_size=12", "schedule.temperature.at=1", "eval.every=1"]),
    ("almn/table2_cub_beta3.yaml",
     ["model.name=synthetic_mlp", "model.options={in_dim: 12, embedding_dim: 8, normalization: none}",
      "train.iterations=4", "train.m=3", "train.n=4", "train.batch_size=12", "schedule.lr.milestones=[2]",
      "eval.every=1"]),
    ("two_head/resnet50_flowers102_hard.yaml",
     ["model.name=synthetic_mlp", "model.options={in_dim: 12, embedding_dim: 8, two_head: true}",
      "train.iterations=4", "train.m=3", "train.n=4", "train.batch_size=12", "eval.every=1"]),
])
def test_recipe_training_sections_run(tmp_path, recipe, overrides):
    """The recipe's loss terms, optimiser, schedules and evaluation run end to end when only
    the data and the backbone are swapped for the synthetic stand-ins."""
    from deepmetric.train import train

    cfg = load_config(ROOT / "recipes" / recipe, SYNTH + overrides + [f"train.out_dir={tmp_path}"])
    res = train(cfg)
    assert (tmp_path / "log.jsonl").is_file() and (tmp_path / "config.yaml").is_file()
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["loss"] == [dict(t.__dict__) for t in cfg.loss]
    assert "recall@1" in res.metrics
    if "two_head" in recipe:
        assert "top1" in res.metrics
