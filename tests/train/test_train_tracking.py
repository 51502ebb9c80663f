"""Experiment tracking (train.loggers): TensorBoard event files read back with TensorBoard's own
EventAccumulator and the MLflow store queried with MlflowClient hold exactly what log.jsonl holds,
also after a run killed (SIGKILL) or failed past its last checkpoint is resumed; the config is
logged as hyperparameters, the summary as final metrics, checkpoints as MLflow artifacts; only
rank 0 tracks; a missing library is a clear error.  No network: MLflow uses SQLite stores."""
import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import yaml
from mlflow import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata as hp_metadata
from tensorboard.plugins.hparams import plugin_data_pb2

from conftest import free_port, synthetic_config
from deepmetric.run.config import ConfigError
from deepmetric.run.config_io import config_from_dict
from deepmetric.train.loop import train
from deepmetric.run.rundir import read_log, read_metrics

SRC = str(Path(__file__).resolve().parents[2] / "src")


# --------------------------------------------------------------------------- independent readers
def tb_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a TensorBoard log directory, ``{tag: [(step, value), ...]}`` in file order."""
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tb_hparams(logdir) -> dict:
    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    content = acc.PluginTagToContent(hp_metadata.PLUGIN_NAME)[hp_metadata.SESSION_START_INFO_TAG]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}


def expected_points(records) -> dict[str, list[tuple[int, float]]]:
    """docs/tracking.md's mapping, spelt out here: step records under their own names, eval
    metrics prefixed by the split (their alpha and epoch left out), baselines at step 0."""
    out = defaultdict(list)
    for r in records:
        if r["type"] == "step":
            for k, v in r.items():
                if k in ("loss", "lr", "alpha", "images_per_s", "epoch") or k.startswith("loss/"):
                    out[k].append((r["step"], v))
        elif r["type"] == "eval":
            for k, v in r.items():
                if k not in ("type", "split", "epoch", "step", "alpha"):
                    out[f"{r['split']}/{k}"].append((r["step"], v))
        elif r["type"] == "baseline" and "skipped" not in r:
            for k, v in r.items():
                if k not in ("type", "name", "label", "split", "epoch", "step"):
                    out[f"baseline/{r['name']}/{k}"].append((0, v))
    return dict(out)


def assert_tensorboard_mirrors_log(logdir, records, extra=()):
    """TensorBoard stores float32: each point must be the log's value rounded to float32, exactly."""
    expected = {tag: [(s, float(np.float32(v))) for s, v in pts] for tag, pts in expected_points(records).items()}
    got = tb_scalars(logdir)
    assert {"loss", "lr", "alpha", "images_per_s", "val/recall@1", "test/recall@1"} <= set(expected)
    assert {t: p for t, p in got.items() if t not in extra} == expected


def mlflow_key(tag):
    return tag.replace("@", "_at_")


def mlflow_history(client, run_id, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def assert_mlflow_mirrors_log(client, run_id, records):
    """MLflow keeps float64: the histories equal the log's values exactly, each point once."""
    run = client.get_run(run_id)
    expected = expected_points(records)
    keys = {mlflow_key(t) for t in expected}
    logged = {k for k in run.data.metrics if not k.startswith(("final/", "best/", "sync/"))
              and k not in ("train_images_per_s", "wall_time_s")}
    assert logged == keys
    for tag, points in expected.items():
        assert mlflow_history(client, run_id, mlflow_key(tag)) == sorted(points), tag
    assert run.data.metrics["sync/log_records"] == len(records)


def flat(mapping, prefix=""):
    """The config flattened by hand: mappings and lists of mappings opened, other values kept."""
    out = {}
    for k, v in mapping.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat(v, key + "."))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for i, x in enumerate(v):
                out.update(flat(x, f"{key}.{i}."))
        else:
            out[key] = v
    return out


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory):
    """An empty MLflow SQLite store, made once (creating the tables takes seconds): tests copy it."""
    db = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def store(tmp_path, mlflow_template):
    """A fresh store of this test, as ``train.tracking.mlflow_uri`` takes it."""
    db = tmp_path / "store" / "mlflow.db"
    db.parent.mkdir()
    shutil.copy(mlflow_template, db)
    return f"sqlite:///{db}"


@pytest.fixture(autouse=True)
def no_tracking_env(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _raw(out_dir, epochs=3, **train_extra):
    return synthetic_config(out_dir, data={"val_classes": 2},
                            schedule={"temperature": {"name": "heat_up", "at": 2}},
                            train={"epochs": epochs, "loggers": ["tensorboard", "mlflow"], **train_extra})


# --------------------------------------------------------------------------- a whole run
def test_run_mirrored_in_tensorboard_and_mlflow_default_store(tmp_path, capsys):
    out = tmp_path / "run"
    raw = _raw(out, tracking={"experiment": "exp-A", "run_name": "trial-7", "tags": {"trial": 7, "sampler": "tpe"}})
    cfg = config_from_dict(raw)
    result = train(cfg)
    records = read_log(out)
    summary = read_metrics(out)
    resolved = flat(yaml.safe_load((out / "config.yaml").read_text()))

    # TensorBoard: scalars, hyperparameters, final metrics
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1
    final = {f"final/test/{k}": v for k, v in summary["final"]["test"].items()}
    final.update({f"final/val/{k}": v for k, v in summary["final"]["val"].items()})
    final["best/val/recall@1"] = summary["selected"]["value"]
    final["best/epoch"] = summary["selected"]["epoch"]
    final.update({f"best/test/{k}": v for k, v in summary["selected"]["test"].items()})
    final.update(train_images_per_s=summary["train_images_per_s"], wall_time_s=summary["wall_time_s"])
    assert_tensorboard_mirrors_log(out / "tensorboard", records, extra=set(final))
    got = tb_scalars(out / "tensorboard")
    assert {t: got[t] for t in final} == {t: [(result.iteration, float(np.float32(v)))] for t, v in final.items()}
    hp = tb_hparams(out / "tensorboard")
    assert set(hp) == set(resolved) and len(hp) > 50
    assert hp["optim.lr"] == 0.05 and hp["loss.0.options.alpha"] == 16.0 and hp["train.epochs"] == 3
    assert hp["optim.name"] == "sgd" and hp["train.progress"] is False
    assert hp["eval.ks"] == "[1, 2, 4, 8]" and hp["train.loggers"] == '["tensorboard", "mlflow"]'
    assert hp["data.val_seed"] == "null"

    # MLflow: the default store is a SQLite file in the run directory
    tracking = json.loads((out / "tracking.json").read_text())["mlflow"]
    assert tracking["tracking_uri"] == f"sqlite:///{out.resolve() / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=tracking["tracking_uri"])
    experiment = client.get_experiment_by_name("exp-A")
    assert experiment.experiment_id == tracking["experiment_id"]
    assert experiment.artifact_location == (out.resolve() / "mlartifacts").as_uri()
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == tracking["run_id"] and run.info.run_name == "trial-7"
    assert run.info.status == "FINISHED"
    assert run.data.tags["trial"] == "7" and run.data.tags["sampler"] == "tpe"
    assert run.data.tags["deepmetric.out_dir"] == str(out.resolve())
    params = run.data.params
    assert set(params) == set(resolved)
    assert params["optim.lr"] == "0.05" and params["optim.name"] == "sgd" and params["train.epochs"] == "3"
    assert params["eval.ks"] == "[1, 2, 4, 8]" and params["train.progress"] == "false"
    assert params["train.tracking.run_name"] == "trial-7"
    assert_mlflow_mirrors_log(client, run.info.run_id, records)
    for tag, value in final.items():
        assert mlflow_history(client, run.info.run_id, mlflow_key(tag)) == [(result.iteration, value)], tag
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"last.pt", "best.pt", "metrics.json", "config.yaml", "log.jsonl"} <= artifacts
    copy = Path(client.download_artifacts(run.info.run_id, "best.pt", str(tmp_path / "dl")))
    assert copy.read_bytes() == (out / "best.pt").read_bytes()

    # a report written after training joins the run
    from deepmetric.cli import main

    assert main(["report", str(out), "--no-embed"]) == 0
    assert f"report stored in MLflow run {run.info.run_id} (artifacts report/)" in capsys.readouterr().out
    stored = {a.path for a in client.list_artifacts(run.info.run_id, "report")}
    assert stored == {f"report/{p.name}" for p in (out / "report").iterdir()} and "report/report.html" in stored


# --------------------------------------------------------------------------- resume
CHILD = r"""
import gc, json, os, signal, sys
from torch.utils.tensorboard import SummaryWriter
import deepmetric.train.tracking as T
from deepmetric.run.config_io import config_from_dict
from deepmetric.train.loop import train

raw, mode = json.loads(sys.argv[1]), sys.argv[2]
on_eval = None
if mode == "while_sending":
    # killed once the epoch-2 last.pt is written, before MLflow got that epoch's records
    calls, send = [0], T.MlflowTracker._checkpointed
    def checkpointed(self):
        calls[0] += 1
        if calls[0] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        send(self)
    T.MlflowTracker._checkpointed = checkpointed
else:
    # killed after epoch 3's evaluations, past the epoch-2 checkpoint, the TensorBoard
    # writer flushed first so that its file holds points a resume must drop
    def on_eval(epoch, metrics, embedded):
        if epoch == 3:
            for obj in gc.get_objects():
                if isinstance(obj, SummaryWriter):
                    obj.flush()
            os.kill(os.getpid(), signal.SIGKILL)
train(config_from_dict(raw), on_eval=on_eval)
"""


def _killed_child(raw, mode):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([SRC] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(raw), mode], env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    assert p.returncode == -9, p.stdout + p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["while_sending", "after_checkpoint"])
def test_killed_run_resumes_without_duplicate_points(tmp_path, store, mode):
    out = tmp_path / "run"
    raw = _raw(out, epochs=4, tracking={"mlflow_uri": store})
    _killed_child(raw, mode)
    run_id = json.loads((out / "tracking.json").read_text())["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=store)
    ckpt_step = torch.load(out / "last.pt", weights_only=True)["iteration"]
    held = client.get_run(run_id).data.metrics["sync/log_records"]
    if mode == "while_sending":
        assert ckpt_step == 8
        # last.pt is written, MLflow missed that epoch's records
        assert held < len(read_log(out)) and mlflow_history(client, run_id, "loss")[-1][0] == 4
    else:
        assert ckpt_step == 8
        # the files hold points past the checkpoint (epoch 3), which the resume drops
        assert max(s for s, _ in tb_scalars(out / "tensorboard")["loss"]) == 12
        assert max(s for s, _ in tb_scalars(out / "tensorboard")["val/recall@1"]) == 12
        assert mlflow_history(client, run_id, "loss")[-1][0] == ckpt_step  # MLflow only had the checkpoint's

    result = train(config_from_dict(raw), resume=out / "last.pt")
    records = read_log(out)
    assert [r["step"] for r in records if r["type"] == "step"] == list(range(1, result.iteration + 1))
    assert [r["event"] for r in records if r["type"] == "heat_up"] == [1]  # fired at step 8, kept once
    assert json.loads((out / "tracking.json").read_text())["mlflow"]["run_id"] == run_id  # the same run
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert_mlflow_mirrors_log(client, run_id, records)
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1
    summary = read_metrics(out)
    final = {f"final/test/{k}" for k in summary["final"]["test"]} | {f"final/val/{k}" for k in summary["final"]["val"]}
    final |= {"best/val/recall@1", "best/epoch", "train_images_per_s", "wall_time_s"}
    final |= {f"best/test/{k}" for k in summary["selected"]["test"]}
    assert_tensorboard_mirrors_log(out / "tensorboard", records, extra=final)


def test_failed_run_resumed_gets_a_new_mlflow_run(tmp_path, store):
    """A run stopped by an exception sent its points past the checkpoint (a pruned trial's last
    validation); resumed, MLflow cannot take points back, so the kept log goes to a new run and
    the old one is deleted."""
    out = tmp_path / "run"
    raw = _raw(out, epochs=4, tracking={"mlflow_uri": store})

    def stop(epoch, val_metrics):
        if epoch == 3:
            raise RuntimeError("pruned at epoch 3")

    with pytest.raises(RuntimeError, match="pruned"):
        train(config_from_dict(raw), on_validation=stop)
    client = MlflowClient(tracking_uri=store)
    old = json.loads((out / "tracking.json").read_text())["mlflow"]["run_id"]
    failed = client.get_run(old)
    assert failed.info.status == "FAILED"
    assert failed.data.tags["deepmetric.error"] == "RuntimeError: pruned at epoch 3"
    assert mlflow_history(client, old, "val/recall_at_1")[-1][0] == 12  # epoch 3's, past the checkpoint
    assert max(s for s, _ in tb_scalars(out / "tensorboard")["loss"]) == 12  # past the epoch-2 checkpoint

    result = train(config_from_dict(raw), resume=out / "last.pt")
    records = read_log(out)
    new = json.loads((out / "tracking.json").read_text())["mlflow"]["run_id"]
    assert new != old and client.get_run(old).info.lifecycle_stage == "deleted"
    (active,) = client.search_runs([client.get_run(new).info.experiment_id])
    assert active.info.run_id == new and active.info.status == "FINISHED"
    assert_mlflow_mirrors_log(client, new, records)
    assert records[-1]["step"] == result.iteration
    assert_tensorboard_mirrors_log(out / "tensorboard", records,
                                   extra={t for t in tb_scalars(out / "tensorboard")
                                          if t.startswith(("final/", "best/")) or t in ("train_images_per_s",
                                                                                        "wall_time_s")})


# --------------------------------------------------------------------------- rank 0 only
def _ddp_worker(rank, world, port, raw):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    train(config_from_dict(raw))


@pytest.mark.slow
def test_only_rank_0_tracks_under_ddp(tmp_path, store):
    out = tmp_path / "run"
    raw = _raw(out, epochs=2, tracking={"mlflow_uri": store, "experiment": "ddp"})
    mp.spawn(_ddp_worker, args=(2, free_port(), raw), nprocs=2, join=True)
    records = read_log(out)
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1
    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("ddp").experiment_id])
    assert_mlflow_mirrors_log(client, run.info.run_id, records)
    got = tb_scalars(out / "tensorboard")
    assert got["loss"] == [(r["step"], float(np.float32(r["loss"]))) for r in records if r["type"] == "step"]


# --------------------------------------------------------------------------- errors, overwrite
def test_logger_names_are_validated(tmp_path):
    with pytest.raises(ConfigError, match=r"'train.loggers.0': expected one of 'tensorboard', 'mlflow', "
                                          r"got 'wandb'"):
        config_from_dict(synthetic_config(tmp_path, train={"loggers": ["wandb"]}))
    with pytest.raises(ConfigError, match="names a logger twice"):
        config_from_dict(synthetic_config(tmp_path, train={"loggers": ["mlflow", "mlflow"]}))
    with pytest.raises(ConfigError, match=r"'train.tracking.tags.x': expected a string key and a string, number"):
        config_from_dict(synthetic_config(tmp_path, train={"tracking": {"tags": {"x": [1]}}}))
    with pytest.raises(ConfigError, match=r"unknown config key 'train.tracking.experiement' \(did you mean "
                                          r"'train.tracking.experiment'\?\)"):
        config_from_dict(synthetic_config(tmp_path, train={"tracking": {"experiement": "a"}}))


def test_missing_library_names_the_extra_before_anything_is_built(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    out = tmp_path / "run"
    with pytest.raises(ImportError) as exc:
        train(config_from_dict(_raw(out)))
    from deepmetric.errors import MissingPackageError

    assert isinstance(exc.value, MissingPackageError)  # what the CLI prints as one line
    assert str(exc.value) == ("config key 'train.loggers' names 'mlflow', but the mlflow-skinny package is not "
                              "installed: pip install 'deepmetric[tracking]' (or remove 'mlflow' from "
                              "train.loggers)")
    assert not out.exists()


def test_overwrite_removes_the_trackers_files_and_a_failing_tracker_does_not_stop_training(tmp_path, monkeypatch,
                                                                                           capsys):
    out = tmp_path / "run"
    raw = synthetic_config(out, train={"epochs": 2, "loggers": ["tensorboard"]})
    train(config_from_dict(raw))
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1
    from deepmetric.train import tracking

    def broken(self, record):
        raise OSError("disk full")

    monkeypatch.setattr(tracking.TensorBoardTracker, "_write", broken)
    result = train(config_from_dict(raw), overwrite=True)
    assert capsys.readouterr().out.count("TensorBoard stopped (logging a record failed: OSError: disk full); "
                                         "training goes on, log.jsonl has every record") == 1
    assert read_metrics(out) is not None and len(read_log(out, type="step")) == result.iteration == 12
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1  # the first run's file is gone
    assert tb_scalars(out / "tensorboard") == {}


def test_a_missing_tracker_package_is_one_line_before_anything_is_built(tmp_path, capsys, monkeypatch):
    """docs/tracking.md: a logger whose library is not installed stops ``deepmetric train`` with
    one line naming the config key and the install command (exit 2, no traceback), before the
    run folder exists; an ImportError without an install command is a bug and still raises."""
    import importlib.util

    from deepmetric import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    out = tmp_path / "run"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(synthetic_config(out, train={"epochs": 1, "loggers": ["mlflow"]})))
    assert cli.main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err == ("deepmetric train: error: config key 'train.loggers' names 'mlflow', but the mlflow-skinny package "
                   "is not installed: pip install 'deepmetric[tracking]' (or remove 'mlflow' from train.loggers)\n")
    assert not out.exists()
    monkeypatch.setattr(importlib.util, "find_spec", real)

    def broken(args):  # a plain ImportError naming an install command is still a bug, not the user's
        raise ImportError("cannot import name 'helper' from 'deepmetric.somewhere' (pip install it?)")

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser.commands["train"].set_defaults(func=broken)
    with pytest.raises(ImportError, match="cannot import name 'helper'"):
        cli.main(["train", str(cfg)])
