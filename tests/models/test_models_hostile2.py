"""Hostile inputs to the model / weights / checkpoint surface, as a user's config or command
line gives them: each is one error naming the option, file or key and what was expected (a
ValueError / TypeError the CLI prints as one line with exit code 2), never a silent
conversion (``int(2.5)``, ``bool("false")``) nor an error the CLI shows as a traceback
(RuntimeError, AssertionError, AttributeError).  Checkpoints are written by hand with
``save_checkpoint`` (nothing is trained)."""
import pickle

import numpy as np
import pytest
import torch

from deepmetric.models import create_model
from deepmetric.run.checkpoint import save_checkpoint
from deepmetric.run.embed import load_model_from_checkpoint

timm = pytest.importorskip("timm")
from safetensors.torch import save_file  # noqa: E402

GLYPH = {"widths": [8, 16], "depths": [1, 1], "in_chans": 3}
VIT = "timm/vit_tiny_patch16_224"


# --------------------------------------------------------------------------- option values
@pytest.mark.parametrize("value", [2.5, True, "8", [8]])
def test_embedding_dim_that_is_no_int_is_refused_not_truncated(value):
    """EmbeddingModel ran int(embedding_dim): 2.5 built a 2-d head, True a 1-d one, "8" an
    8-d one, and "abc" failed with int()'s message, which names no option."""
    with pytest.raises(ValueError, match=r"^embedding_dim must be a positive int \(or 0: no linear layer\), got "):
        create_model("glyph_resnet", embedding_dim=value, **GLYPH)
    with pytest.raises(ValueError, match="^embedding_dim must be a positive int"):
        create_model("two_head", backbone="glyph_resnet", num_classes=3, input_size=32, embedding_dim=value,
                     **GLYPH)
    assert create_model("glyph_resnet", embedding_dim=np.int64(8), **GLYPH).embedding_dim == 8  # a tuner's int


def test_two_head_embedding_dim_0_reports_the_size_it_embeds():
    """embedding_dim 0 (no linear layer) embeds the flattened map, but the model said
    embedding_dim 0, which the loss terms are built with."""
    model = create_model("two_head", backbone="glyph_resnet", num_classes=3, input_size=32, embedding_dim=0,
                         **GLYPH).eval()
    out = model(torch.randn(2, 3, 32, 32))
    assert model.embedding_dim == out["embedding"].shape[1] == 16 * 16 * 16


@pytest.mark.parametrize("option, value, name", [
    ({"bias": "false"}, "false", "bias"),
    ({"bn_divide_sqrt_k": "no"}, "no", "bn_divide_sqrt_k"),
    ({"dropout": "0.2"}, "0.2", "dropout"),
    ({"bn_momentum": "x"}, "x", "bn_momentum"),
    ({"depths": [0, 1]}, 0, "glyph_resnet: depths entry"),
    ({"widths": [-8, 16]}, -8, "glyph_resnet: widths entry"),
])
def test_wrong_option_values_name_the_option(option, value, name):
    """A string "false" counted as true; depth 0 still built a block; a negative width or a
    string dropout failed inside torch or Python with a message naming no option."""
    with pytest.raises(ValueError, match=f"^{name} must be .*, got {value!r}$"):
        create_model("glyph_resnet", embedding_dim=4, **{**GLYPH, **option})


@pytest.mark.parametrize("model, option, value", [
    ("lenet", "hidden", -1),
    ("googlenet", "transform_input", "yes"),
    ("two_head", "embedding_head", "no"),
    ("two_head", "input_size", 2.5),
    ("efficientnet_lite0", "drop_path_rate", "x"),
    (VIT, "grad_checkpointing", "yes"),
    (VIT, "dynamic_img_size", "yes"),
    (VIT, "img_size", "x"),
    (VIT, "drop_path_rate", "x"),
])
def test_backbone_option_values_name_the_option(model, option, value):
    kwargs = {"backbone": "glyph_resnet", "num_classes": 3, "input_size": 32, **GLYPH} if model == "two_head" else {}
    with pytest.raises(ValueError, match=f"{option} must be .*, got {value!r}"):
        create_model(model, **{**kwargs, option: value})


@pytest.mark.parametrize("value", [5, True, ["a.pth"]])
def test_pretrained_of_another_type_says_what_is_expected(value):
    with pytest.raises(TypeError, match=r"pretrained must be None, 'imagenet' .*'hub' .* got "):
        create_model(VIT, pretrained=value)


@pytest.mark.parametrize("model", ["resnet18", "timm/convnext_atto"])
def test_pretrained_folder_or_imagenet_on_timm(tmp_path, model):
    """A folder was 'weights file not found'; 'imagenet' on a timm model a file named 'imagenet'."""
    with pytest.raises(IsADirectoryError, match=f"pretrained weights '{tmp_path}' is a folder; pass the weights file"):
        create_model(model, pretrained=str(tmp_path))
    if model.startswith("timm/"):
        with pytest.raises(ValueError, match=r"pretrained='imagenet' .* is for the EfficientNet-Lite backbones, "
                                             r"not 'timm/convnext_atto'; a timm/<name> model takes 'hub'"):
            create_model(model, pretrained="imagenet")


# --------------------------------------------------------------------------- timm names and sizes
def test_unknown_timm_tag_is_a_value_error_listing_the_tags():
    """timm raised RuntimeError('Invalid pretrained tag'), which the CLI shows as a traceback."""
    with pytest.raises(ValueError, match=r"no weights tag 'augreg_in21' .*Did you mean "
                                         r"'timm/vit_tiny_patch16_224.augreg_in21k'.*Its tags: augreg_in21k, "):
        create_model(VIT + ".augreg_in21")


def test_unknown_timm_name_is_named_before_options_it_would_not_take():
    """A checkpoint or config naming a timm model that no longer exists, with options of
    another model, was reported as 'got unknown argument(s)'."""
    with pytest.raises(ValueError, match="unknown timm model 'no_such_net'"):
        create_model("timm/no_such_net", widths=[8, 16])


def test_vit_input_sizes_it_cannot_take():
    with pytest.raises(ValueError, match=r"timm/vit_tiny_patch16_224 cannot take 8x8 inputs .*img_size"):
        create_model(VIT, img_size=8)  # smaller than a patch: torch's RuntimeError before
    model = create_model(VIT, img_size=32, embedding_dim=4).eval()
    assert model(torch.randn(1, 3, 32, 32))["embedding"].shape == (1, 4)
    with pytest.raises(ValueError, match=r"built for 32x32 images .*got 48x32.*dynamic_img_size"):
        model(torch.randn(1, 3, 48, 32))  # timm's AssertionError before
    dynamic = create_model(VIT, img_size=32, dynamic_img_size=True, embedding_dim=4).eval()
    assert dynamic(torch.randn(1, 3, 48, 32))["embedding"].shape == (1, 4)


# --------------------------------------------------------------------------- weights files
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("weights")
    (d / "empty.pth").write_bytes(b"")
    (d / "notes.pth").write_text("weights are on the shared drive\n")
    (d / "notes.safetensors").write_text("weights are on the shared drive\n")
    torch.save({"epoch": 3, "acc": 0.5}, d / "other_project.pth")
    torch.save([torch.zeros(1)], d / "list.pth")
    (d / "code.pth").write_bytes(pickle.dumps({"a": print}, protocol=4))  # a pickle, not torch.save
    return d


@pytest.mark.parametrize("model", ["resnet18", "timm/convnext_atto"])
@pytest.mark.parametrize("name, message", [
    ("empty.pth", "the file is empty"),
    ("notes.pth", "it is a text file .*'weights are on the shared drive'"),
    ("notes.safetensors", "it is a text file"),
    ("other_project.pth", "is not a plain state dict: entries epoch, acc are not tensors"),
    ("list.pth", r"does not contain a state dict \(got list\)"),
    ("code.pth", "holds Python objects other than tensors"),
])
def test_weights_files_that_are_no_state_dict(files, model, name, message):
    """torch.load's 'KeyError: 101' / 'EOFError: ' said nothing; the timm path passed a dict
    of numbers to timm's filter ("'int' object has no attribute 'ndim'") and repeated torch's
    advice to retry with weights_only=False."""
    with pytest.raises(ValueError, match=message) as info:
        create_model(model, pretrained=str(files / name))
    text = str(info.value)
    assert name in text and "\n" not in text and "weights_only=False" not in text


def test_a_plain_pickle_warns_nothing(files, recwarn):
    """torch.load warns 'Detected pickle protocol 4' for a plain pickle: a second line on the
    CLI's stderr above the one error line."""
    with pytest.raises(ValueError, match="holds Python objects"):
        create_model("resnet18", pretrained=str(files / "code.pth"))
    assert not [w for w in recwarn if "pickle protocol" in str(w.message)]


def test_timm_training_checkpoint_loads_its_ema_weights(tmp_path):
    """timm's own training checkpoints (EMA weights first, an argparse.Namespace of arguments)."""
    import argparse

    net = timm.create_model("convnext_atto", pretrained=False)
    ema = {k: v + 1 if v.is_floating_point() else v for k, v in net.state_dict().items()}
    torch.save({"state_dict": net.state_dict(), "state_dict_ema": ema, "args": argparse.Namespace(lr=0.1)},
               tmp_path / "checkpoint.pth.tar")
    model = create_model("timm/convnext_atto", embedding_dim=4, pretrained=str(tmp_path / "checkpoint.pth.tar"))
    assert torch.equal(model.backbone.net.stem[0].weight, ema["stem.0.weight"])


def test_safetensors_missing_keys_name_the_file_and_keys(tmp_path):
    state = timm.create_model("convnext_atto", pretrained=False).state_dict()
    del state["stem.0.weight"]
    save_file(state, str(tmp_path / "cut.safetensors"))
    with pytest.raises(ValueError, match=r"cut.safetensors' do not match ConvNeXt: missing keys .*stem.0.weight"):
        create_model("timm/convnext_atto", pretrained=str(tmp_path / "cut.safetensors"))


# --------------------------------------------------------------------------- checkpoints
def _config(folder, model: dict, transform=("resize_crop", {"resize": 36, "crop": 32})) -> dict:
    return {
        "data": {"name": "folder", "root": str(folder), "transform": transform[0],
                 "transform_options": transform[1], "num_workers": 0},
        "model": model,
        "loss": [{"name": "heated_softmax", "options": {"alpha": 16.0}}],
        "optim": {"name": "sgd", "lr": 0.05},
        "train": {"iterations": 1, "batch_size": 8, "seed": 0, "progress": False},
        "eval": {"every": 0, "split": "train"},
    }


def _checkpoint(path, config: dict, net, loss: list | None = None, **edits):
    """A checkpoint of ``net`` as 'deepmetric train' writes it, minus what loading never reads."""
    from deepmetric.run.config_io import config_from_dict
    from deepmetric.run.builders import build_losses

    if loss is None:
        losses = build_losses(config_from_dict(config), num_classes=4, embedding_dim=net.embedding_dim)
        loss = [term.state_dict() for term in losses]
    state = {"model": net.state_dict(), "loss": loss, "config": config,
             "model_args": {"num_classes": 4, "embedding_dim": net.embedding_dim, "world_size": 1}}
    state.update(edits)
    return save_checkpoint(state, path)


@pytest.fixture
def glyph(tmp_path):
    model = create_model("glyph_resnet", embedding_dim=8, **GLYPH)
    return _config(tmp_path, {"name": "glyph_resnet", "options": {"embedding_dim": 8, **GLYPH}}), model


def test_a_good_hand_made_checkpoint_loads(tmp_path, glyph):
    cfg, model = glyph
    loaded, losses, _, _ = load_model_from_checkpoint(_checkpoint(tmp_path / "ok.pt", cfg, model))
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("edit, message", [
    # a model that no longer exists (a module not imported, a name removed): which checkpoint?
    (lambda c, m: ({**c, "model": {"name": "my_net", "options": {}}}, {}),
     r"checkpoint .*gone.pt: cannot rebuild its model 'my_net' from the config it holds: unknown model 'my_net'"),
    (lambda c, m: ({**c, "model": {"name": "timm/my_net", "options": c["model"]["options"]}}, {}),
     r"checkpoint .*gone.pt: cannot rebuild its model 'timm/my_net' .*unknown timm model 'my_net'"),
    (lambda c, m: ({**c, "loss": [{"name": "no_such_loss"}]}, {}),
     r"checkpoint .*gone.pt: cannot rebuild its loss terms .*unknown loss 'no_such_loss'"),
    # edited / damaged entries: AttributeError and RuntimeError tracebacks before
    (lambda c, m: (c, {"model_args": "num_classes=4"}),
     r"checkpoint .*gone.pt: 'model_args' is of type str, expected a mapping"),
    (lambda c, m: (c, {"loss": [{"foo": torch.zeros(1)}]}),
     r"checkpoint .*gone.pt: its saved loss term 0 \(heated_softmax\) weights do not fit .*not in the model: foo"),
    (lambda c, m: (c, {"model": {k: v for i, (k, v) in enumerate(m.state_dict().items()) if i}}),
     r"checkpoint .*gone.pt: its saved model weights do not fit the model its config builds: 1 tensor\(s\) "
     r"missing in the checkpoint: backbone.stem.0.weight$"),
    (lambda c, m: ({**c, "model": {**c["model"], "options": {**c["model"]["options"], "embedding_dim": 32}}}, {}),
     r"its saved model weights do not fit .*with another shape \(checkpoint -> now\): head.proj.weight \[8, 16\] "
     r"-> \[32, 16\]"),
])
def test_checkpoint_that_cannot_be_rebuilt_is_one_line_naming_it(tmp_path, glyph, edit, message):
    cfg, model = glyph
    config, edits = edit(cfg, model)
    if "loss" in edits or config["loss"] != cfg["loss"]:
        edits.setdefault("loss", [])
    path = _checkpoint(tmp_path / "gone.pt", config, model, **edits)
    with pytest.raises(ValueError, match=message) as info:
        load_model_from_checkpoint(path)
    assert "\n" not in str(info.value)


def test_embed_and_export_of_a_checkpoint_whose_model_is_gone(tmp_path, glyph, capsys):
    from deepmetric import cli

    cfg, model = glyph
    path = _checkpoint(tmp_path / "gone.pt", {**cfg, "model": {"name": "my_net", "options": {}}}, model, loss=[])
    for argv, out in ((["embed", str(path), "--out", str(tmp_path / "e.npz")], tmp_path / "e.npz"),
                      (["export", str(path), "--format", "torchscript", "--out", str(tmp_path / "m.pt")],
                       tmp_path / "m.pt")):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "gone.pt: cannot rebuild its model 'my_net'" in err, err
        assert not out.exists()


def test_embed_a_vit_checkpoint_on_images_of_another_size(tmp_path, capsys):
    """A ViT trained on images its transform does not resize (img_size = the first image's
    size), embedded on a folder of larger images: timm's AssertionError gave a traceback
    (exit 1); now one line naming the size, exit 2, nothing written."""
    from deepmetric import cli
    from search_data import make_shapes_folder

    folder = make_shapes_folder(tmp_path / "big", per_class=1)  # 40 px images
    options = {"embedding_dim": 8, "pool": "cls", "img_size": [32, 32]}
    cfg = _config(folder, {"name": VIT, "options": options},
                  transform=("mnist", {"channels": 3, "normalize": "imagenet"}))
    path = _checkpoint(tmp_path / "vit.pt", cfg, create_model(VIT, **options))
    out = tmp_path / "emb.npz"
    assert cli.main(["embed", str(path), "--split", "all", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "was built for 32x32 images" in err and "got 40x40" in err
    assert not out.exists()


@pytest.mark.parametrize("name", ["resnet18", "timm/resnet18"])
@pytest.mark.parametrize("given", ["none", "None", "false"])
def test_pretrained_none_written_as_a_string_says_how_to_write_null(name, given):
    """model.options.pretrained: none (YAML reads it as the string 'none') was looked for as a
    weights file: 'pretrained weights file not found: 'none'', nothing on what to write."""
    with pytest.raises(FileNotFoundError, match=rf"not found: '{given}' .*for no pretrained weights write "
                                                r"model.options.pretrained: null"):
        create_model(name, embedding_dim=4, pretrained=given)
    with pytest.raises(FileNotFoundError) as err:
        create_model(name, embedding_dim=4, pretrained="missing.pth")
    assert "null" not in str(err.value)
