"""deepmetric.run.config: typed YAML configs, key suggestions, overrides, round trips."""
from pathlib import Path

import pytest
import yaml

from deepmetric.run.config import Config, ConfigError, config_to_dict
from deepmetric.run.config_io import apply_overrides, config_from_dict, load_config, save_config

REPO = Path(__file__).resolve().parents[2]


def _minimal(**extra):
    raw = {"train": {"epochs": 2}}
    raw.update(extra)
    return raw


def test_defaults_and_nested_types():
    cfg = config_from_dict(_minimal(loss=[{"name": "triplet", "weight": 0.5, "options": {"margin": 0.2}},
                                          {"name": "cross_entropy", "input": "logits"}]))
    assert isinstance(cfg, Config)
    assert cfg.train.epochs == 2 and cfg.train.iterations is None
    assert [t.name for t in cfg.loss] == ["triplet", "cross_entropy"]
    assert cfg.loss[0].weight == 0.5 and cfg.loss[1].input == "logits"
    assert cfg.eval.ks == [1, 2, 4, 8]
    # heat-up factor defaults of the paper (1/4 alpha, 1/10 lr) and of the gradual variant
    assert config_from_dict(_minimal(schedule={"temperature": {"name": "heat_up", "at": 3}})
                            ).schedule.temperature.alpha_factor == 0.25
    g = config_from_dict(_minimal(schedule={"temperature": {"name": "gradual", "every": 10}})).schedule.temperature
    assert g.alpha_factor == pytest.approx(1 / 1.41) and g.lr_factor == pytest.approx(0.562)


@pytest.mark.parametrize("raw, path, suggestion", [
    ({"optim": {"lrr": 0.1}}, "optim.lrr", "optim.lr"),
    ({"trian": {"seed": 1}}, "trian", "train"),
    ({"loss": [{"name": "triplet", "inptu": "logits"}]}, "loss.0.inptu", "loss.0.input"),
    ({"schedule": {"temperature": {"nmae": "heat_up"}}}, "schedule.temperature.nmae", "schedule.temperature.name"),
])
def test_unknown_key_names_path_and_suggests(raw, path, suggestion):
    with pytest.raises(ConfigError) as exc:
        config_from_dict({**_minimal(), **raw})
    msg = str(exc.value)
    assert f"'{path}'" in msg and f"'{suggestion}'" in msg


def test_unknown_key_without_close_match_lists_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.zzzzzz'.*valid keys.*momentum"):
        config_from_dict(_minimal(optim={"zzzzzz": 1}))


@pytest.mark.parametrize("raw, key, expected", [
    ({"optim": {"lr": "fast"}}, "optim.lr", "float"),
    ({"train": {"epochs": "ten"}}, "train.epochs", "int"),
    ({"train": {"epochs": 2, "channels_last": 3}}, "train.channels_last", "bool"),
    ({"eval": {"ks": [1, "a"]}}, "eval.ks.1", "int"),
    ({"data": {"options": [1, 2]}}, "data.options", "mapping"),
    ({"train": {"epochs": 2, "amp": "bf61"}}, "train.amp", "'bf16'"),
    ({"optim": "sgd"}, "optim", "mapping"),
])
def test_wrong_type_names_key_and_expected_type(raw, key, expected):
    merged = _minimal()
    for k, v in raw.items():
        merged[k] = v
    with pytest.raises(ConfigError) as exc:
        config_from_dict(merged)
    assert f"'{key}'" in str(exc.value) and expected in str(exc.value)


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="exactly one of 'train.epochs' and 'train.iterations'"):
        config_from_dict({})
    with pytest.raises(ConfigError, match="exactly one"):
        config_from_dict({"train": {"epochs": 1, "iterations": 5}})
    with pytest.raises(ConfigError, match="train.m"):
        config_from_dict({"train": {"epochs": 1, "sampler": "class_balanced"}})
    with pytest.raises(ConfigError, match="schedule.temperature.at"):
        config_from_dict(_minimal(schedule={"temperature": {"name": "heat_up"}}))
    with pytest.raises(ConfigError, match="out of range"):
        config_from_dict(_minimal(schedule={"temperature": {"name": "heat_up", "at": 1, "losses": [3]}}))


def test_overrides_are_yaml_parsed_and_validated():
    raw = apply_overrides(_minimal(), ["optim.lr=1e-3", "eval.ks=[1, 10]", "train.amp=bf16",
                                       "loss.0.options={alpha: 8}", "train.m=null"])
    cfg = config_from_dict(raw)
    assert cfg.optim.lr == 0.001 and isinstance(cfg.optim.lr, float)
    assert cfg.eval.ks == [1, 10] and cfg.train.amp == "bf16"
    assert cfg.loss[0].options == {"alpha": 8}
    with pytest.raises(ConfigError, match="did you mean 'optim.lr'"):
        config_from_dict(apply_overrides(_minimal(), ["optim.lrr=1"]))
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        apply_overrides({}, ["optim.lr"])
    with pytest.raises(ConfigError, match="index 5 out of range"):
        apply_overrides({"loss": [{}]}, ["loss.5.weight=1"])


def test_load_save_round_trip(tmp_path):
    src = tmp_path / "run.yaml"
    src.write_text(yaml.safe_dump({"train": {"epochs": 3, "seed": 7},
                                   "loss": [{"name": "heated_softmax", "options": {"alpha": 16}}],
                                   "schedule": {"temperature": {"name": "heat_up", "at": 2}}}))
    cfg = load_config(src, ["optim.name=adam"])
    out = save_config(cfg, tmp_path / "sub" / "config.yaml")
    again = load_config(out)
    assert again == cfg
    assert config_to_dict(again)["optim"]["name"] == "adam"
    # every default is written out (the resolved config)
    written = yaml.safe_load(out.read_text())
    assert written["schedule"]["temperature"]["lr_factor"] == 0.1
    assert written["train"]["seed"] == 7


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {epochs: 2}\noptim: {lrr: 1}\n")
    with pytest.raises(ConfigError, match=r"bad.yaml.*optim.lrr"):
        load_config(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)


@pytest.mark.parametrize("data", ["emoji", "glyphs"])
def test_demo_recipe_is_the_demo_config(data):
    from deepmetric.workflows.demo import demo_config, demo_recipe

    recipe = REPO / "recipes" / f"demo_{data}.yaml"
    assert demo_recipe(data).resolve() == recipe.resolve()  # the demo reads the shipped recipe
    cfg = load_config(recipe)
    assert demo_config(data=data, overrides=[f"train.out_dir={cfg.train.out_dir}"]) == cfg
    assert cfg.model.options["norm"] == "bn"
    if data == "glyphs":  # the glyph demo shows heating-up; the emoji demo is the transfer recipe
        assert cfg.schedule.temperature.name == "heat_up"
    else:
        assert cfg.eval.cross_domain and cfg.model.options["embedding_dim"] == 0
