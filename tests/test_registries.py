"""The registries (datasets, transforms, models, losses, metrics) are the only way in.

Each registry lists its names and their options; these tests check the lists against what
the builders themselves accept or reject (their own error messages and signatures), that an
unknown name raises the same error everywhere, that a decorator refuses a name twice, and
that a newly registered entry is built and checked by the config checks without any other
edit (preflight keeps no list of its own).
"""
import contextlib
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from deepmetric.data import (build_dataset, build_transform, canonical_dataset_name, dataset_options,
                             is_event_dataset, list_datasets, list_transforms, register_dataset,
                             register_transform, transform_options)
from deepmetric.data.registry import DATASETS
from deepmetric.data.transforms import TRANSFORMS
from deepmetric.data.synthetic import GaussianClusters
from deepmetric.evaluate import check_metric_names, evaluate, list_metrics, metric_keys
from deepmetric.losses import build_loss, list_losses, loss_class, loss_options, register_loss
from deepmetric.losses.registry import LOSSES
from deepmetric.models.registry import MODELS
from deepmetric.models import (create_model, list_models, model_backbone, model_needs_num_classes, model_options,
                               register_model)
from deepmetric.models.synthetic import SyntheticMLP
from deepmetric.run.builders import build_split
from deepmetric.run.builders import build_losses, build_model
from deepmetric.run.config import ConfigError
from deepmetric.run.config_io import config_from_dict
from deepmetric.run.config_checks import check_config_options


@pytest.fixture
def scratch_registries():
    """Registrations made in a test are undone after it (the registries are module state,
    restored in place: every module holding a reference sees the restored table)."""
    with contextlib.ExitStack() as stack:
        for registry in (DATASETS, TRANSFORMS, MODELS, LOSSES):
            stack.enter_context(registry.scratch())
        yield


def _cfg(**sections):
    raw = {"train": {"epochs": 1}}
    raw.update(sections)
    return config_from_dict(raw)


def _accepted_in(message: str) -> set[str]:
    """The names after 'accepted: ' in a builder's own error message."""
    return set(message.split("accepted: ")[1].split(", "))


# ----------------------------------------------------------------------------- datasets
def test_every_dataset_is_listed_once_by_its_canonical_name():
    names = list_datasets()
    assert names == sorted(set(names))
    assert {"cub", "folder", "csv", "glyphs", "emoji", "fashion-mnist", "events", "hdd", "synthetic-events",
            "synthetic"} <= set(names)
    for name in names:
        assert canonical_dataset_name(name) == name
    for alias, name in (("CUB_200_2011", "cub"), ("cub200", "cub"), ("Stanford Cars", "cars196"),
                        ("honda", "hdd"), ("synthetic_events", "synthetic-events"), ("FashionMNIST", "fashion-mnist"),
                        ("Synthetic", "synthetic")):
        assert canonical_dataset_name(alias) == name


@pytest.mark.parametrize("name", ["cub", "cars196", "sop", "inshop", "flowers102", "aircraft", "dogs", "nabirds",
                                  "folder", "csv"])
def test_file_dataset_options_are_what_build_dataset_accepts(name, tmp_path):
    # the builder's own check names the options it accepts, before any file is read
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['zzz'\]") as err:
        build_dataset(name, tmp_path, zzz=1)
    assert dataset_options(name) == _accepted_in(str(err.value))
    assert {"skip_missing", "verify", "mode"} <= dataset_options(name)


@pytest.mark.parametrize("name", ["events", "hdd"])
def test_event_datasets_check_their_own_options(name, tmp_path):
    assert dataset_options(name) is None  # several loaders share EventDataset's options
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['zzz'\]; accepted: .*random_window"):
        build_dataset(name, tmp_path, zzz=1)


@pytest.mark.parametrize("name", ["glyphs", "emoji", "synthetic-events", "synthetic"])
def test_builder_options_are_its_keywords(name):
    options = dataset_options(name)
    assert options and not options & {"split", "transform", "root"}
    with pytest.raises(TypeError, match="zzz"):  # the builder itself rejects anything else
        build_dataset(name, zzz=1)


def test_synthetic_dataset_is_built_through_the_registry():
    assert dataset_options("synthetic") == {"num_classes", "per_class", "dim", "noise", "seed", "augment"}
    ds = build_dataset("synthetic", split="test", num_classes=3, per_class=4, dim=5, seed=2)
    ref = GaussianClusters("test", num_classes=3, per_class=4, dim=5, seed=2)
    assert torch.equal(ds.x, ref.x) and np.array_equal(ds.labels, ref.labels)
    # the training builders build it through the registry too
    cfg = _cfg(data={"name": "synthetic", "options": {"num_classes": 3, "per_class": 4, "dim": 5}})
    assert torch.equal(build_split(cfg, "train", train=True)[0][0], GaussianClusters("train", num_classes=3,
                                                                                      per_class=4, dim=5)[0][0])


def test_event_datasets_are_marked():
    assert [n for n in list_datasets() if is_event_dataset(n)] == ["events", "hdd", "synthetic-events"]
    assert is_event_dataset("Honda") and not is_event_dataset("no-such-data") and not is_event_dataset(3)


def test_unknown_dataset_raises_the_same_error_everywhere():
    with pytest.raises(ValueError) as err:
        build_dataset("cars197")
    assert re.match(r"unknown dataset 'cars197'\. Known: aircraft, cars196, .*\. Did you mean 'cars196'", str(err.value))
    for fn in (canonical_dataset_name, dataset_options):
        with pytest.raises(ValueError) as again:
            fn("cars197")
        assert str(again.value) == str(err.value)
    with pytest.raises(TypeError, match="dataset name must be a string"):
        dataset_options(7)


def test_register_dataset_refuses_a_name_twice(scratch_registries):
    with pytest.raises(ValueError, match=r"\['cub'\] already registered"):
        register_dataset("cub")(lambda split, transform, root: None)
    with pytest.raises(ValueError, match=r"\['cub'\] already registered"):  # an alias is a name too
        register_dataset("my-birds", aliases=("CUB",))(lambda split, transform, root: None)
    with pytest.raises(ValueError, match="lower case"):
        register_dataset("My_Data")
    assert "my-birds" not in list_datasets()


# ----------------------------------------------------------------------------- transforms
def test_transform_options_are_what_build_transform_accepts():
    assert list_transforms() == ["emoji", "glyph", "mnist", "resize_crop", "short_side", "sod", "timm"]
    for name in list_transforms():
        with pytest.raises(TypeError, match=r"unknown option\(s\) \['zzz'\]; allowed: (.*)") as err:
            build_transform(name, train=True, zzz=1)
        allowed = set(re.findall(r"'(\w+)'", str(err.value).split("allowed: ")[1]))
        assert transform_options(name) == allowed and "train" not in allowed
    assert {"channels", "normalize"} <= transform_options("glyph")
    assert "channels" not in transform_options("resize_crop")  # always three channels


def test_unknown_transform_and_duplicate_registration(scratch_registries):
    with pytest.raises(ValueError) as err:
        build_transform("mnsit", train=True)
    with pytest.raises(ValueError) as again:
        transform_options("mnsit")
    assert str(again.value) == str(err.value) and "unknown transform 'mnsit'" in str(err.value)
    with pytest.raises(ValueError, match="transform 'glyph' is already registered"):
        register_transform("glyph")(lambda train: None)


# ----------------------------------------------------------------------------- models
def test_model_options_are_what_create_model_accepts():
    for name in list_models():
        options = model_options(name)
        assert options is not None and options >= {"embedding_dim", "num_classes"}
    # every option of a small model is accepted; anything else is refused by the factory itself
    create_model("glyph_resnet", widths=[8, 16], depths=[1, 1], pool="max", bn_momentum=0.1, dropout=0.1)
    assert {"widths", "depths", "pool", "bn_momentum"} <= model_options("glyph_resnet")
    with pytest.raises(TypeError, match="unknown argument"):
        create_model("glyph_resnet", zzz=1)
    assert "widths" not in model_options("resnet18")
    # two_head: its own options and those of the backbone the options choose
    assert {"backbone", "input_size", "embedding_head"} <= model_options("two_head")
    assert "widths" in model_options("two_head", {"backbone": "glyph_resnet"})
    assert "widths" not in model_options("two_head", {"backbone": "resnet18"})
    assert "widths" not in model_options("two_head")  # default backbone resnet50
    create_model("two_head", backbone="glyph_resnet", widths=[8, 16], depths=[1, 1], num_classes=3, input_size=32)


def test_model_backbone_and_num_classes():
    assert model_backbone("resnet18") == "resnet18"
    assert model_backbone("two_head") == "resnet50"  # docs/models.md: two_head's default backbone
    assert model_backbone("two_head", {"backbone": "lenet"}) == "lenet"
    assert model_backbone("synthetic_mlp") is None
    assert [n for n in list_models() if model_needs_num_classes(n)] == ["two_head"]
    with pytest.raises(ValueError, match="needs num_classes"):
        create_model("two_head", backbone="lenet")
    assert "logits" not in create_model("lenet")(torch.randn(2, 1, 28, 28))


def test_unknown_model_raises_the_same_error_everywhere():
    with pytest.raises(ValueError) as err:
        create_model("resnt18")
    assert str(err.value).startswith("unknown model 'resnt18'. Did you mean 'resnet18'?")
    for fn in (model_options, model_backbone, model_needs_num_classes):
        with pytest.raises(ValueError) as again:
            fn("resnt18")
        assert str(again.value) == str(err.value)


def test_register_model_refuses_a_name_twice(scratch_registries):
    for name in ("two_head", "resnet18", "synthetic_mlp"):
        with pytest.raises(ValueError, match=f"model '{name}' is already registered"):
            register_model(name)(SyntheticMLP)


def test_model_options_of_impossible_size_are_a_config_error(scratch_registries):
    """A layer of negative size is torch's RuntimeError, which the CLI shows as a traceback:
    the built-in MLP checks its sizes, and a model registered elsewhere that does not gets a
    ConfigError naming model.options from the builder."""
    from deepmetric.run.builders import build_model
    from deepmetric.run.config import ConfigError

    with pytest.raises(ValueError, match=r"^synthetic_mlp: embedding_dim must be a positive int, got -8$"):
        create_model("synthetic_mlp", embedding_dim=-8)
    with pytest.raises(ValueError, match=r"synthetic_mlp: hidden must be a positive int, got 0"):
        create_model("synthetic_mlp", hidden=0)

    class Unchecked(nn.Module):
        def __init__(self, width: int = 4, num_classes=None):
            super().__init__()
            self.layer = nn.Linear(4, width)

    register_model("unchecked_width")(Unchecked)
    cfg = _cfg(model={"name": "unchecked_width", "options": {"width": -3}})
    with pytest.raises(ConfigError, match=r"^config key 'model.options': model 'unchecked_width' cannot be built "
                                          r"with options \{'width': -3\}: .*negative dimension -3"):
        build_model(cfg)
    assert isinstance(build_model(_cfg(model={"name": "unchecked_width", "options": {"width": 3}})).layer, nn.Linear)


def test_synthetic_mlp_is_created_like_any_model():
    assert model_options("synthetic_mlp") == {"in_dim", "hidden", "embedding_dim", "normalization", "num_classes",
                                              "two_head"}
    torch.manual_seed(0)
    model = create_model("synthetic_mlp", in_dim=5, hidden=7, embedding_dim=3, num_classes=4, two_head=True)
    torch.manual_seed(0)
    ref = SyntheticMLP(in_dim=5, hidden=7, embedding_dim=3, num_classes=4, two_head=True)
    # same parameters under the same names: checkpoints of the old builder keep loading
    assert model.state_dict().keys() == ref.state_dict().keys()
    for key, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[key], value)
    with pytest.raises(TypeError, match="norm"):  # common arguments it does not take are refused
        create_model("synthetic_mlp", norm="bn")
    cfg = _cfg(data={"name": "synthetic"}, model={"name": "synthetic_mlp", "options": {"hidden": 7}})
    assert isinstance(build_model(cfg, num_classes=4), SyntheticMLP)
    assert build_model(cfg, num_classes=4).classifier is None  # no loss reads logits: no classifier


def test_create_model_none_means_default():
    # None is the model's default (timm's create_model): dropout=None is no dropout
    torch.manual_seed(0)
    a = create_model("lenet", dropout=None)
    torch.manual_seed(0)
    b = create_model("lenet", dropout=0.0)
    assert repr(a) == repr(b) and isinstance(a.head.dropout, nn.Identity)
    for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y)


# ----------------------------------------------------------------------------- losses
def test_every_loss_is_registered_where_defined():
    assert list_losses() == sorted(list_losses())
    assert {"heated_softmax", "almn", "triplet", "center", "contrastive", "npair", "lifted", "proxy_nca",
            "cross_entropy", "pml", "similarity_distillation"} == set(list_losses())
    for name in list_losses():
        cls = loss_class(name)
        assert issubclass(cls, nn.Module) and cls.__module__ == f"deepmetric.losses.{name}"


def test_loss_options_are_what_build_loss_accepts():
    assert loss_options("triplet") == {"margin", "mining", "soft_margin", "reduction", "normalize"}
    assert loss_options("pml") is None  # PML's own options, checked by the PML class
    for name in list_losses():
        options = loss_options(name)
        if options is None:
            continue
        with pytest.raises(TypeError, match=r"unknown option 'zzz'; accepted: (.*)") as err:
            build_loss(name, zzz=1)
        assert _accepted_in(str(err.value)) == options


def test_unknown_loss_raises_the_same_error_everywhere():
    with pytest.raises(ValueError) as err:
        build_loss("arcface")
    assert str(err.value) == f"unknown loss 'arcface'; expected one of {list_losses()}"
    for fn in (loss_class, loss_options):
        with pytest.raises(ValueError) as again:
            fn("arcface")
        assert str(again.value) == str(err.value)


def test_register_loss_refuses_a_name_twice(scratch_registries):
    with pytest.raises(ValueError, match=r"loss 'triplet' is already registered \(by TripletLoss\)"):
        register_loss("triplet")(nn.Module)
    with pytest.raises(ValueError, match="non-empty string"):
        register_loss("")(nn.Module)


def test_pml_is_listed_without_pytorch_metric_learning():
    code = ("import sys; sys.modules['pytorch_metric_learning'] = None\n"
            "from deepmetric.losses import list_losses, loss_class, build_loss\n"
            "assert 'pml' in list_losses() and loss_class('pml').__name__ == 'PMLLoss'\n"
            "try:\n    build_loss('pml', loss='ProxyAnchorLoss')\n"
            "except ImportError as e:\n    print('needs:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "needs: loss 'pml' needs pytorch-metric-learning" in out


# ----------------------------------------------------------------------------- metrics
def test_metric_names(rng):
    assert list_metrics() == ["recall", "map@r", "r_precision", "mrr", "map@k", "recall_class_avg",
                              "map@r_class_avg", "nmi", "f1", "ami"]
    assert check_metric_names(None) == ("recall", "map@r", "r_precision", "nmi", "f1")
    assert check_metric_names("nmi") == ("nmi",)
    x = rng.standard_normal((12, 3)).astype(np.float32)
    y = np.repeat(np.arange(3), 4)
    got = evaluate(x, y, ks=(1, 2))
    assert sorted(got) == sorted(["recall@1", "recall@2", "map@r", "r_precision", "nmi", "f1"])
    got = evaluate(x, y, ks=(1, 2), metrics=list_metrics())
    assert list(got) == metric_keys(list_metrics(), (1, 2)) == [
        "recall@1", "recall@2", "map@r", "r_precision", "mrr", "map@1", "map@2", "recall@1_class_avg",
        "recall@2_class_avg", "map@r_class_avg", "nmi", "f1", "ami"]
    for bad in (["nmi", "mAP"], []):
        with pytest.raises(ValueError) as err:
            check_metric_names(bad)
        with pytest.raises(ValueError) as again:
            evaluate(x, y, metrics=bad)
        assert str(again.value) == str(err.value) and "choose from recall, map@r" in str(err.value)


# ----------------------------------------------------------------------------- a new entry needs no other edit
def test_a_registered_dataset_model_and_loss_train_without_any_other_edit(scratch_registries):
    """What docs/data.md, docs/models.md and docs/losses.md say to do, and nothing else:
    the config checks and the training builders find the new names through the registries."""

    @register_dataset("tiny-blobs", aliases=("blobs",))
    def build_tiny(split="train", transform=None, root=None, *, classes=3):
        return GaussianClusters(split, num_classes=classes, per_class=4, dim=6, transform=transform)

    @register_model("tiny_mlp")
    def tiny_mlp(embedding_dim=4, num_classes=None, width=8):
        return SyntheticMLP(in_dim=6, hidden=width, embedding_dim=embedding_dim, num_classes=num_classes)

    @register_loss("tiny_loss")
    class TinyLoss(nn.Module):
        def __init__(self, scale: float = 1.0, num_classes: int | None = None):
            super().__init__()
            self.scale, self.num_classes = scale, num_classes

        def forward(self, embeddings, labels):
            return self.scale * embeddings.pow(2).mean()

    @register_transform("tiny_noise")
    def tiny_noise(train, sigma=0.0):
        return (lambda x: x + sigma * torch.randn_like(x)) if train else (lambda x: x)

    assert "tiny-blobs" in list_datasets() and "tiny_mlp" in list_models() and "tiny_loss" in list_losses()
    cfg = _cfg(data={"name": "Blobs", "options": {"classes": 4}, "transform": "tiny_noise"},
               model={"name": "tiny_mlp", "options": {"width": 5}},
               loss=[{"name": "tiny_loss", "options": {"scale": 2.0}}])
    check_config_options(cfg)
    train = build_split(cfg, "train", train=True)
    assert train.num_classes == 4
    model = build_model(cfg, num_classes=train.num_classes)
    (loss,) = build_losses(cfg, num_classes=train.num_classes, embedding_dim=4)
    assert loss.num_classes == 4 and loss.scale == 2.0  # num_classes filled in: the loss takes it
    emb = model(train[0][0][None])["embedding"]
    assert loss(emb, torch.tensor([0])).item() == pytest.approx(2.0 * emb.pow(2).mean().item())  # scale 2 reached it
    for section, bad, message in (
            ("data", {"name": "tiny-blobs", "options": {"clases": 4}},
             r"'data.options.clases': unknown option 'clases' for dataset 'tiny-blobs' \(did you mean 'classes'"),
            ("data", {"name": "tiny-blobs", "transform": "tiny_noise", "transform_options": {"sigm": 1}},
             r"'data.transform_options.sigm': .* for transform 'tiny_noise' \(did you mean 'sigma'"),
            ("model", {"name": "tiny_mlp", "options": {"widht": 5}},
             r"'model.options.widht': .* for model 'tiny_mlp' \(did you mean 'width'"),
            ("loss", [{"name": "tiny_loss", "options": {"scael": 1}}],
             r"'loss.0.options.scael': .* for loss 'tiny_loss' \(did you mean 'scale'")):
        with pytest.raises(ConfigError, match=message):
            check_config_options(_cfg(**{section: bad}))


def test_pair_based_losses_declare_it_on_their_class():
    """Under DDP a pair-based term sees every rank's embeddings: the loss class says so itself
    (no table of names in train/)."""
    from deepmetric.losses import list_losses, loss_class
    from deepmetric.train.module import is_pair_based

    assert {n for n in list_losses() if is_pair_based(loss_class(n))} == {"triplet", "npair", "almn", "contrastive",
                                                                          "lifted"}


# ----------------------------------------------------------------------------- the Registry class itself
def test_registry_register_aliases_and_normalisation():
    from deepmetric.registry import Registry

    reg = Registry("widget", normalize=lambda s: s.lower().replace("_", "-"))

    @reg.register("big-box", aliases=("Crate",), colour="red")
    def big_box(size=1, *, lid=False):
        return ("box", size, lid)

    reg.add("small-box", lambda: "small")
    assert reg.names() == ["big-box", "small-box"] and len(reg) == 2
    assert list(reg) == ["big-box", "small-box"]  # registration order
    for spelling in ("big-box", "BIG_BOX", "crate", "CRATE"):
        assert spelling in reg and reg.canonical(spelling) == "big-box" and reg.get(spelling) is big_box
    assert 3 not in reg and "crate-2" not in reg
    assert reg.info("crate") == {"colour": "red"}
    reg.info("crate")["colour"] = "blue"  # a copy: the registry keeps its own
    assert reg.info("big-box") == {"colour": "red"}


def test_registry_refuses_a_name_or_alias_twice():
    from deepmetric.registry import Registry

    reg = Registry("widget", normalize=str.lower)
    reg.add("box", object, aliases=("crate",))
    for name, aliases in (("BOX", ()), ("bin", ("Crate",)), ("crate", ())):
        with pytest.raises(ValueError, match="widget '.*' is already registered"):
            reg.add(name, object, aliases=aliases)
    with pytest.raises(ValueError, match="non-empty string"):
        reg.add("", object)
    assert reg.names() == ["box"] and "bin" not in reg


def test_registry_unknown_name_names_the_closest():
    from deepmetric.registry import Registry, did_you_mean

    reg = Registry("widget")
    reg.add("gadget", object, aliases=("gizmo",))
    reg.add("sprocket", object)
    with pytest.raises(ValueError) as err:
        reg.get("gadgte")
    assert str(err.value) == "unknown widget 'gadgte' (did you mean 'gadget'?); available: gadget, sprocket"
    with pytest.raises(ValueError) as err:  # an alias is matched, the name it stands for suggested
        reg.canonical("gizmos")
    assert "(did you mean 'gadget'?)" in str(err.value)
    with pytest.raises(ValueError) as err:
        reg.get("zzzzzz")
    assert str(err.value) == "unknown widget 'zzzzzz'; available: gadget, sprocket"
    custom = Registry("widget", unknown="no {kind} {name!r}.{Hint} Known: {names}")
    custom.add("gadget", object)
    with pytest.raises(ValueError) as err:
        custom.get("gadgte")
    assert str(err.value) == "no widget 'gadgte'. Did you mean 'gadget'? Known: ['gadget']"
    assert did_you_mean("lrr", ["lr", "momentum"], prefix="optim.") == " (did you mean 'optim.lr'?)"
    assert did_you_mean("xyz", ["lr"]) == ""


def test_registry_options_build_and_check_options():
    from deepmetric.registry import Registry, signature_options

    reg = Registry("widget")

    @reg.register("box")
    class Box:
        def __init__(self, size, *, lid=False, colour="red"):
            self.size, self.lid, self.colour = size, lid, colour

    @reg.register("anything")
    def anything(**options):
        return options

    assert reg.options("box") == {"size", "lid", "colour"}
    assert reg.options("box", skip=("size",)) == {"lid", "colour"}
    assert reg.options("anything") is None and signature_options(anything) is None
    box = reg.build("box", 3, lid=True)
    assert (box.size, box.lid, box.colour) == (3, True, "red")
    assert reg.build("anything", zzz=1) == {"zzz": 1}  # **options: it checks its own
    with pytest.raises(TypeError) as err:
        reg.build("box", 3, lidd=True)
    assert str(err.value) == "widget 'box': unknown option 'lidd' (did you mean 'lid'?)"
    with pytest.raises(TypeError) as err:
        reg.check_options("box", ["zzz"], skip=("size",), where="my box")
    assert str(err.value) == "my box: unknown option 'zzz'; accepted: colour, lid"
    reg.check_options("box", ["size", "colour"])


def test_registry_scratch_undoes_registrations():
    from deepmetric.registry import Registry

    reg = Registry("widget")
    reg.add("box", object)
    with reg.scratch():
        reg.add("crate", object, aliases=("bin",))
        assert reg.names() == ["box", "crate"]
    assert reg.names() == ["box"] and "bin" not in reg
    reg.add("crate", object)  # free again


# ----------------------------------------------------------------------------- metric keys read from the registry
def test_evaluation_keys_are_the_declared_keys():
    from deepmetric.evaluate import evaluation_keys

    assert evaluation_keys(None, (4, 1)) == ["recall@1", "recall@4", "map@r", "r_precision", "nmi", "f1"]
    assert evaluation_keys([], (1,), classification=True) == ["top1", "mean_per_class"]
    assert evaluation_keys(["nmi", "map@k"], (2,), cross_domain=True) == [
        "map@2", "nmi", "cross_domain_map@2"]  # the retrieval metrics of the selection
    assert evaluation_keys(["ami"], (1, 2), cross_domain=True) == [
        "ami", "cross_domain_recall@1", "cross_domain_recall@2", "cross_domain_map@r"]  # none: recall, map@r
    with pytest.raises(ValueError, match=r"unknown metric\(s\) \['top1'\]; choose from recall, map@r"):
        evaluation_keys(["top1"], (1,))  # a classification key is no evaluate() metric
