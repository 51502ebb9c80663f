"""Checkpoints: atomic writes, weights_only loading, RNG state, exact resume after SIGINT and
SIGKILL, non-finite loss handling."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from deepmetric.run import checkpoint as ck
from deepmetric.train.state import TrainState
from deepmetric.run.config_io import config_from_dict
from deepmetric.train.loop import NonFiniteLossError, train
from conftest import synthetic_config
from deepmetric.run.rundir import read_log


def _raw(out_dir, **train_extra):
    return synthetic_config(out_dir, classes=8, per_class=24, data_seed=3,
                            loss=[{"name": "heated_softmax", "options": {"alpha": 16.0}},
                                  {"name": "center", "weight": 0.01}],
                            schedule={"temperature": {"name": "heat_up", "at": 2}},
                            train={"sampler": "class_balanced", "m": 4, "n": 4, "seed": 11, **train_extra})


def test_atomic_save_keeps_previous_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    ck.save_checkpoint({"model": {"w": torch.ones(3)}, "config": {}}, path)

    def broken_save(obj, f, *a, **k):
        f.write(b"partial garbage")
        raise OSError("disk full")

    monkeypatch.setattr(ck.torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        ck.save_checkpoint({"model": {"w": torch.zeros(3)}, "config": {}}, path)
    monkeypatch.undo()
    state = ck.load_checkpoint(path)
    assert torch.equal(state["model"]["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]  # no temp file left


def test_missing_and_corrupt_checkpoints_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere.pt"):
        ck.load_checkpoint(tmp_path / "nothere.pt")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\x00not a checkpoint")
    with pytest.raises(ValueError, match=r"bad\.pt is corrupt"):
        ck.load_checkpoint(bad)
    # truncated real checkpoint
    good = ck.save_checkpoint({"model": {"w": torch.randn(1000)}, "config": {}}, tmp_path / "t.pt")
    good.write_bytes(good.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"t\.pt is corrupt"):
        ck.load_checkpoint(good)
    # a config or an image given as the checkpoint is named as such (torch said "Unsupported operand 100")
    config = tmp_path / "cfg.yaml"
    config.write_text("data: {name: synthetic}\n")
    with pytest.raises(ValueError, match=r"cfg\.yaml is a text file \(it starts with 'data: \{name: synthetic\}'\), "
                                         r"not a checkpoint \(last\.pt / best\.pt"):
        ck.load_checkpoint(config)
    other = tmp_path / "other.pt"
    torch.save({"hello": 1}, other)
    with pytest.raises(ValueError, match="not a deepmetric checkpoint"):
        ck.load_checkpoint(other)
    # edited by hand: a config or weights that are not mappings are named, not torch's own errors
    for key, value, said in (("config", [1, 2], r"'config' is of type list, expected a mapping \(the training config\)"),
                             ("model", 5, r"'model' is of type int, expected a mapping \(parameter name -> tensor\)")):
        edited = ck.save_checkpoint({"model": {"w": torch.zeros(2)}, "config": {}, key: value}, tmp_path / f"{key}.pt")
        with pytest.raises(ValueError, match=rf"checkpoint .*{key}\.pt: {said}; the file was edited"):
            ck.load_checkpoint(edited)


def test_rng_state_round_trip_through_weights_only_file(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # leave a cached gaussian around
    ck.save_checkpoint({"model": {}, "config": {}, "rng": ck.get_rng_state()}, tmp_path / "r.pt")
    first = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    state = torch.load(tmp_path / "r.pt", weights_only=True)
    ck.set_rng_state(state["rng"])
    again = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    assert first == again


def test_training_checkpoint_contents_load_weights_only(tmp_path):
    cfg = config_from_dict(_raw(tmp_path / "run"))
    result = train(cfg)
    state = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert state["epoch"] == 3 and state["iteration"] == result.iteration
    assert state["alphas"][0] == pytest.approx(4.0) and state["alphas"][1] is None  # heated up at epoch 2
    assert set(state["loss"][0]) >= {"weight"} and "centers" in state["loss"][1]
    assert state["optimizer"]["state"]  # momentum buffers
    assert state["schedules"]["temperature"]["events"] == 1
    assert set(state["rng"][0]) >= {"python", "numpy", "torch"}
    assert config_from_dict(state["config"]) == cfg
    assert not (tmp_path / "run" / "best.pt").exists()  # no validation split: nothing selected
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["train"]["seed"] == 11


def _wait_for(pred, proc, timeout=120.0):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.002)
    return False


def _cli(args, cwd):
    """``deepmetric train`` in its own session (process group), as in a terminal: Ctrl-C
    reaches the main process and its loader workers (``os.killpg``)."""
    src = str(Path(__file__).resolve().parents[2] / "src")  # this checkout's sources, whatever the cwd
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([src] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    return subprocess.Popen([sys.executable, "-m", "deepmetric.cli", "train", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def test_resume_after_sigint_and_sigkill_matches_uninterrupted_run(tmp_path):
    """Ctrl-C mid-epoch (checkpoint saved, exit 130), resume, SIGKILL after the next
    checkpoint, resume again: same final weights, loss state and metrics as one run.
    With a loader worker and random augmentation (each sample seeded by its position), and
    the Ctrl-C message printed once although the worker gets the signal too."""
    epochs = 8

    def augmented(raw):
        raw["data"]["options"]["augment"] = 0.2
        raw["data"]["num_workers"] = 1
        raw["eval"]["every"] = 3
        raw["schedule"]["temperature"]["at"] = 5
        return raw

    ref = train(config_from_dict(augmented(_raw(tmp_path / "ref", epochs=epochs, checkpoint_every=1))))

    run = tmp_path / "run"
    raw = augmented(_raw(run, epochs=epochs))
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    log = run / "log.jsonl"
    last = run / "last.pt"

    def n_steps():
        return log.read_text().count('"type": "step"') if log.exists() else 0

    # 1) Ctrl-C after a few steps of the first epoch (before any checkpoint exists)
    p = _cli([str(cfg_path)], tmp_path)
    assert _wait_for(lambda: n_steps() >= 5, p), p.communicate()[0]
    os.killpg(p.pid, signal.SIGINT)  # like Ctrl-C in a terminal: main process and worker
    out = p.communicate(timeout=120)[0]
    assert p.returncode == 130, out
    assert out.count("interrupt received") == 1 and out.count("checkpoint saved to") == 1, out
    s1 = torch.load(last, weights_only=True)
    assert 0 < s1["iteration"] < epochs * 12, "the SIGINT checkpoint must be mid-run"

    # 2) resume, then SIGKILL as soon as a newer checkpoint appears
    mtime = last.stat().st_mtime_ns
    p = _cli([str(cfg_path), "--resume", str(last)], tmp_path)
    assert _wait_for(lambda: last.stat().st_mtime_ns != mtime, p), p.communicate()[0]
    os.killpg(p.pid, signal.SIGKILL)
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL
    s2 = torch.load(last, weights_only=True)
    assert s1["iteration"] < s2["iteration"] < epochs * 12, "the run must be killed before the end"

    # 3) resume to the end
    p = _cli([str(cfg_path), "--resume", str(last)], tmp_path)
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 0, out

    a = torch.load(tmp_path / "ref" / "last.pt", weights_only=True)
    b = torch.load(last, weights_only=True)
    assert a["iteration"] == b["iteration"] == ref.iteration
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for la, lb in zip(a["loss"], b["loss"]):
        for k in la:
            assert torch.equal(la[k], lb[k]), k
    assert a["alphas"] == b["alphas"] == [4.0, None]
    ma = json.loads((tmp_path / "ref" / "metrics.json").read_text())
    mb = json.loads((run / "metrics.json").read_text())
    assert ma["metrics"] == mb["metrics"] and ma["final"] == mb["final"] and ma["selected"] == mb["selected"]
    # the log holds each step exactly once despite the two interruptions
    steps = [r["step"] for r in read_log(log, type="step")]
    assert steps == list(range(1, ref.iteration + 1))


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    raw = _raw(tmp_path / "run", epochs=3)
    raw["loss"] = [{"name": "heated_softmax"}]
    raw["model"]["options"]["normalization"] = "none"
    # epoch 0 trains normally; from epoch 1 the lr is 1e29: the weights overflow.
    raw["schedule"] = {"lr": {"name": "step", "step_size": 1, "gamma": 1e30}}
    cfg = config_from_dict(raw)
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss .* at step \d+ \(epoch 2") as exc:
        train(cfg)
    assert "last.pt" in str(exc.value)
    state = ck.load_checkpoint(tmp_path / "run" / "last.pt")
    assert state["epoch"] == 1
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def _as_version_1(state: dict) -> dict:
    """The layout written before TrainState: ``epoch_loss: [sum, n]`` and ``meta``."""
    old = {k: v for k, v in state.items() if k not in ("epoch_loss_sum", "epoch_loss_n", "model_args")}
    old.update(version=1, epoch_loss=[state["epoch_loss_sum"], state["epoch_loss_n"]],
               meta=state["model_args"])
    return old


def test_version_1_checkpoints_still_resume_and_rebuild(tmp_path):
    """A version-1 file (upgraded in memory by load_checkpoint) resumes to the same weights as
    an uninterrupted run, and ``load_model_from_checkpoint`` rebuilds its model."""
    from deepmetric.run.embed import load_model_from_checkpoint

    ref = train(config_from_dict(_raw(tmp_path / "ref", epochs=3)))
    train(config_from_dict(_raw(tmp_path / "first", epochs=2)))
    state = torch.load(tmp_path / "first" / "last.pt", weights_only=True)
    assert state["version"] == ck.CHECKPOINT_VERSION == 2 and state["epoch"] == 2
    v1 = tmp_path / "v1.pt"
    ck.save_checkpoint(_as_version_1(state), v1)
    assert torch.load(v1, weights_only=True)["version"] == 1
    loaded = ck.load_checkpoint(v1)
    assert loaded["model_args"] == state["model_args"] and "meta" not in loaded
    assert (loaded["epoch_loss_sum"], loaded["epoch_loss_n"]) == (state["epoch_loss_sum"], state["epoch_loss_n"])

    res = train(config_from_dict(_raw(tmp_path / "resumed", epochs=3)), resume=v1)
    assert res.iteration == ref.iteration
    # it applied the version-1 states: only the third epoch was trained here
    assert [r["step"] for r in read_log(tmp_path / "resumed", type="step")] == list(
        range(state["iteration"] + 1, ref.iteration + 1))
    a = torch.load(tmp_path / "ref" / "last.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "resumed" / "last.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    model, _, _, _ = load_model_from_checkpoint(v1)
    assert all(torch.equal(model.state_dict()[k], state["model"][k]) for k in state["model"])


def test_newer_checkpoint_version_is_refused(tmp_path):
    path = ck.save_checkpoint({"model": {}, "config": {}, "version": 99}, tmp_path / "future.pt")
    with pytest.raises(ValueError, match=r"future\.pt has format version 99"):
        ck.load_checkpoint(path)


def test_train_state_is_what_a_checkpoint_saves_and_restores(tmp_path):
    """checkpoint_dict writes every TrainState field; restore reads the same values back."""
    from dataclasses import asdict

    train(config_from_dict(_raw(tmp_path / "run", epochs=1)))
    saved = ck.load_checkpoint(tmp_path / "run" / "last.pt")
    fields = asdict(TrainState())
    assert set(fields) <= set(saved)
    assert (saved["epoch"], saved["batch_in_epoch"], saved["epoch_loss_n"]) == (1, 0, 0)
    assert saved["best"]["value"] is None and saved["metrics"]["recall@1"] > 0  # no validation split


def test_corrupt_resume_checkpoint_is_reported_first_without_unsafe_advice(tmp_path, capsys):
    """A damaged --resume file fails before the run summary is printed, names the file and
    never repeats torch's advice to load with weights_only=False."""
    import os
    import pickle

    from deepmetric import cli

    run = tmp_path / "run"
    base = ["train", "data.name=synthetic", "data.options={num_classes: 4, per_class: 6, dim: 8}",
            "model.name=synthetic_mlp", "model.options={in_dim: 8, embedding_dim: 4}",
            "train.epochs=1", "train.batch_size=8", f"train.out_dir={run}", "train.progress=false"]
    assert cli.main(base) == 0
    capsys.readouterr()
    last = run / "last.pt"
    good = last.read_bytes()
    tampered = tmp_path / "tampered.pt"
    with open(tampered, "wb") as f:
        pickle.dump({"x": os.system}, f)  # a pickle that would run code
    for bad, why in ((good[: len(good) // 2], "Error"), (tampered.read_bytes(), "Python objects other than tensors")):
        last.write_bytes(bad)
        assert cli.main(base + ["--resume", str(last)]) == 2
        out, err = capsys.readouterr()
        assert f"checkpoint {last} is corrupt or unreadable" in err and why in err
        assert "weights_only=False" not in err + out and "weights_only` set to `False" not in err + out
        assert out == ""  # nothing printed before the error: no run summary
    # an empty file (a save that never completed): said so, not torch's bare "EOFError: "
    last.write_bytes(b"")
    assert cli.main(base + ["--resume", str(last)]) == 2
    assert f"checkpoint {last} is empty (0 bytes)" in capsys.readouterr().err
