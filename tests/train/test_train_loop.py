"""The training loop on synthetic data: logs, optimiser groups, warm-up, AMP, gradient
accumulation, auto-plateau heating inside the loop, the embed/evaluate CLI round trip."""
import json

import numpy as np
import pytest
import torch

from deepmetric import cli
from deepmetric.run.config_io import config_from_dict
from deepmetric.run.builders import build_model, seed_everything
from deepmetric.train.loop import train
from deepmetric.train.optim import build_optimizer
from conftest import synthetic_config
from deepmetric.run.rundir import read_log


def _raw(out_dir, **train_extra):
    return synthetic_config(out_dir, train=train_extra)


def _records(path, kind):
    return read_log(path, type=kind)


def test_end_to_end_run_writes_config_log_checkpoints_and_learns(tmp_path):
    raw = _raw(tmp_path, epochs=6)
    raw["eval"]["at_start"] = True
    res = train(config_from_dict(raw))
    steps, evals = _records(tmp_path / "log.jsonl", "step"), _records(tmp_path / "log.jsonl", "eval")
    per_epoch = 96 // 16
    assert [r["step"] for r in steps] == list(range(1, 6 * per_epoch + 1)) and res.iteration == 6 * per_epoch
    assert all({"loss", "lr", "alpha", "images_per_s", "epoch"} <= set(r) for r in steps)
    assert [r["epoch"] for r in evals] == list(range(0, 7))
    assert all(0.0 <= r["recall@1"] <= 1.0 and "nmi" in r for r in evals)
    first = np.mean([r["loss"] for r in steps[:per_epoch]])
    last = np.mean([r["loss"] for r in steps[-per_epoch:]])
    assert last < 0.8 * first  # it trains
    summary = json.loads((tmp_path / "metrics.json").read_text())
    assert {k: summary["metrics"][k] for k in ("recall@1", "nmi")} == {k: evals[-1][k] for k in ("recall@1", "nmi")}
    assert all(r["split"] == "test" for r in evals)
    # no validation split: nothing is selected, the final model is the result
    assert summary["selected"] is None and res.selected is None and not (tmp_path / "best.pt").exists()
    assert summary["final"] == {"test": summary["metrics"]} == res.final
    assert summary["epochs"] == 6 and summary["steps"] == res.iteration
    # the logged Recall@1 of the last evaluation, recomputed here by brute force from last.pt:
    # each test point's nearest other point by cosine has its class
    from deepmetric.run.builders import build_split
    from deepmetric.run.embed import load_model_from_checkpoint

    model, _, cfg, _ = load_model_from_checkpoint(tmp_path / "last.pt")
    test = build_split(cfg, "test", train=False)
    with torch.no_grad():
        x = torch.stack([test[i][0] for i in range(len(test))])
        e = torch.nn.functional.normalize(model.eval()(x)["embedding"], dim=1).numpy()
    sims = e @ e.T
    np.fill_diagonal(sims, -np.inf)
    labels = np.asarray([test[i][1] for i in range(len(test))])
    assert evals[-1]["recall@1"] == pytest.approx(np.mean(labels[sims.argmax(1)] == labels), abs=1e-6)
    assert summary["wall_time_s"] > 0 and summary["train_images_per_s"] > 0
    for name in ("config.yaml", "last.pt"):
        assert (tmp_path / name).is_file()


@pytest.mark.parametrize("fails", [False, True])
def test_a_run_sets_threads_and_determinism_for_itself_and_puts_the_callers_back(tmp_path, fails):
    """``train.num_threads`` / ``train.deterministic`` hold while the run trains; afterwards (and
    after a run that raised) the calling process has its own settings again: a notebook that
    trains once is not left on other threads."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(False)
    seen = []

    def on_eval(epoch, metrics, embedded):
        seen.append((torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()))
        if fails:
            raise RuntimeError("the caller's callback failed")

    cfg = config_from_dict(_raw(tmp_path, epochs=1, num_threads=2, deterministic=True))
    if fails:
        with pytest.raises(RuntimeError, match="callback failed"):
            train(cfg, on_eval=on_eval)
    else:
        train(cfg, on_eval=on_eval)
    assert seen and set(seen) == {(2, True)}  # the run's own settings while it ran
    assert torch.get_num_threads() == 1 and not torch.are_deterministic_algorithms_enabled()


def test_param_groups_new_layer_multiplier_and_regex_override():
    cfg = config_from_dict({
        "train": {"epochs": 1}, "model": {"name": "synthetic_mlp", "options": {"in_dim": 4}},
        "optim": {"lr": 0.01, "new_layer_lr_mult": 10.0, "weight_decay": 1e-4,
                  "param_groups": [{"pattern": r"^model\.head\.bias$", "lr_mult": 0.0, "weight_decay": 0.0}]},
    })
    model = build_model(cfg)
    losses = torch.nn.ModuleList([torch.nn.Linear(8, 3)])  # stands for a classifier loss's W
    opt = build_optimizer(model, losses, cfg.optim)
    lr_of = {n: (g["lr"], g["weight_decay"]) for g in opt.param_groups for n in g["param_names"]}
    assert lr_of["model.backbone.0.weight"] == (pytest.approx(0.01), 1e-4)       # backbone: base lr
    assert lr_of["model.head.weight"] == (pytest.approx(0.1), 1e-4)              # new layer: 10x
    assert lr_of["model.head.bias"] == (0.0, 0.0)                                # regex override
    assert lr_of["loss.0.weight"] == (pytest.approx(0.1), 1e-4)                  # loss params: new layers
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters())) + 2


def test_warmup_new_layers_keeps_backbone_fixed(tmp_path):
    cfg = config_from_dict(_raw(tmp_path, epochs=1, warmup_epochs=1))
    cfg.eval.every = 0
    seed_everything(cfg.train.seed)
    init = build_model(cfg, num_classes=6).state_dict()  # the loop seeds and builds identically
    train(cfg)
    final = torch.load(tmp_path / "last.pt", weights_only=True)["model"]
    assert torch.equal(final["backbone.0.weight"], init["backbone.0.weight"])
    assert not torch.equal(final["head.weight"], init["head.weight"])


def test_grad_accum_bf16_iterations(tmp_path):
    cfg = config_from_dict(_raw(tmp_path, epochs=None, iterations=5, grad_accum=2, amp="bf16"))
    res = train(cfg)
    steps = _records(tmp_path / "log.jsonl", "step")
    assert res.iteration == 5 and len(steps) == 5
    assert all(np.isfinite(r["loss"]) for r in steps)
    assert steps[-1]["epoch"] == pytest.approx(10 / 6)  # 2 batches per step, 6 batches per epoch


def test_fp16_needs_cuda(tmp_path):
    with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
        train(config_from_dict(_raw(tmp_path, amp="fp16", device="cpu")))


def test_auto_plateau_heats_up_inside_the_loop(tmp_path):
    raw = _raw(tmp_path, epochs=5)
    raw["optim"]["lr"] = 0.0  # the loss cannot improve: a plateau from the first epoch
    raw["eval"]["every"] = 0
    raw["schedule"] = {"temperature": {"name": "auto_plateau", "monitor": "train_loss", "patience": 2,
                                       "min_delta": 1e-4}}
    train(config_from_dict(raw))
    heats = _records(tmp_path / "log.jsonl", "heat_up")
    assert len(heats) == 1 and heats[0]["epoch"] == 3  # best at 1, bad at 2 and 3
    alphas = [r["alpha"] for r in _records(tmp_path / "log.jsonl", "step")]
    per_epoch = 6
    assert set(alphas[: 3 * per_epoch]) == {16.0} and set(alphas[3 * per_epoch:]) == {4.0}
    assert torch.load(tmp_path / "last.pt", weights_only=True)["alphas"] == [4.0]


def test_embed_cli_round_trip_with_query_gallery(tmp_path, capsys):
    raw = _raw(tmp_path / "run", epochs=2)
    raw["eval"].update({"split": "query", "gallery_split": "gallery"})
    res = train(config_from_dict(raw))
    npz = tmp_path / "emb.npz"
    assert cli.main(["embed", str(tmp_path / "run" / "last.pt"), "--split", "query+gallery", "--out", str(npz)]) == 0
    z = np.load(npz)
    assert z["embeddings"].shape == (96, 8) and z["is_query"].sum() == 48 and (z["is_query"] ^ z["is_gallery"]).all()
    out = tmp_path / "m.json"
    assert cli.main(["evaluate", str(npz), "--out", str(out)]) == 0
    metrics = json.loads(out.read_text())
    metrics = metrics.get("metrics", metrics)
    for k in ("recall@1", "recall@8"):
        assert metrics[k] == pytest.approx(res.metrics[k], abs=1e-9)


def test_cli_train_reports_config_errors(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps(_raw(tmp_path / "run")))
    assert cli.main(["train", str(cfg), "optim.lrr=0.1"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'optim.lrr'" in err and "did you mean 'optim.lr'" in err
    assert cli.main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    assert cli.main(["embed", str(tmp_path / "none.pt"), "--out", str(tmp_path / "e.npz")]) == 2
    assert "none.pt" in capsys.readouterr().err


def test_imports_run_one_way():
    """builders and embed never import the loop (loop, embed and demo import the builders)."""
    import ast
    from pathlib import Path

    import deepmetric

    src = Path(deepmetric.__file__).parent

    def imported(path: str, source: str | None = None) -> tuple[set, set]:
        """The absolute names of the modules ``path`` (or ``source`` as if it were ``path``)
        imports from, and of everything it imports (``from .a import b``:
        ``deepmetric.<package>.a`` and ``...a.b``)."""
        package = ["deepmetric", *Path(path).parent.parts]
        modules, names = set(), set()
        for node in ast.walk(ast.parse(source if source is not None else (src / path).read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                modules.add(target)
                names.update(f"{target}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                modules.update(a.name for a in node.names)
                names.update(a.name for a in node.names)
        return modules, names

    def imports_the_loop(path: str, source: str | None = None) -> bool:
        modules, names = imported(path, source)
        return any(n == "deepmetric.train.loop" or n.startswith("deepmetric.train.loop.") for n in modules | names)

    builders = {m for m in imported("run/builders.py")[0] if m.startswith("deepmetric")}
    assert builders <= {"deepmetric.run.config", "deepmetric.run.config_checks", "deepmetric.data",
                        "deepmetric.data.synthetic", "deepmetric.models", "deepmetric.losses"}, builders
    for name in ("run/builders.py", "run/embed.py", "run/device.py", "run/checkpoint.py", "train/module.py"):
        assert not imports_the_loop(name), name
    assert "deepmetric.run.builders" in imported("train/setup.py")[0]
    # the check itself sees every spelling of an import of the loop
    for spelling in ("from ..train.loop import train", "from ..train import loop", "from deepmetric.train import loop",
                     "import deepmetric.train.loop", "def f():\n    from deepmetric.train.loop import train"):
        assert imports_the_loop("run/embed.py", spelling), spelling
    assert imports_the_loop("train/module.py", "from .loop import train")
    assert not imports_the_loop("run/embed.py", "from ..train import setup")
