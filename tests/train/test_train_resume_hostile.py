"""Resume cannot overwrite another run (issue 32, items 9-10): ``--resume OTHER_RUN/last.pt``
into a non-empty ``train.out_dir`` of a different run is refused without ``--overwrite`` (and
nothing there is touched); resuming a run in its own directory (or from a byte-identical copy
of its ``last.pt``) still works; temporary files a killed save left (``.last.pt.PID.*.tmp``)
are removed at the next start of the run when their process is gone, never a live one's."""
import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from deepmetric import cli
from deepmetric.run import checkpoint as ck
from deepmetric.run.config_io import config_from_dict
from deepmetric.run.rundir import RunDirectoryError
from deepmetric.train.loop import train
from deepmetric.run.rundir import STALE_UNTAGGED_S, read_log
from conftest import synthetic_config


def _raw(out_dir, epochs=2, seed=0):
    raw = synthetic_config(out_dir, per_class=8, hidden=16, train={"epochs": epochs, "batch_size": 12})
    raw["train"]["seed"] = seed
    return raw


def _state(run):
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(run.iterdir())}


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid  # reaped: no process has it (PIDs are not reused this quickly)


def test_resume_of_another_run_into_a_used_directory_is_refused(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    train(config_from_dict(_raw(a)))
    train(config_from_dict(_raw(b, seed=1)))
    before = _state(a)
    with pytest.raises(RunDirectoryError) as exc:
        train(config_from_dict(_raw(a, epochs=3)), resume=b / "last.pt")
    msg = str(exc.value)
    assert f"--resume {b / 'last.pt'} is another run's checkpoint" in msg and f"{a / 'last.pt'}" in msg
    assert "--overwrite" in msg and "\n" not in msg
    assert _state(a) == before  # last.pt, log.jsonl: untouched
    # the same through the command line: one line, exit 2
    cfg = tmp_path / "a.yaml"
    cfg.write_text(yaml.safe_dump(_raw(a, epochs=3)))
    capsys.readouterr()
    assert cli.main(["train", str(cfg), "--resume", str(b / "last.pt")]) == 2
    err = capsys.readouterr().err
    assert "is another run's checkpoint" in err and "Traceback" not in err and err.count("\n") == 1
    assert _state(a) == before
    # --overwrite: the old run's files go, the resumed one continues from b's step
    steps_b = [r["step"] for r in read_log(b, type="step")]
    assert cli.main(["train", str(cfg), "--resume", str(b / "last.pt"), "--overwrite"]) == 0
    steps = [r["step"] for r in read_log(a, type="step")]
    assert steps[0] == steps_b[-1] + 1 and steps == list(range(steps[0], steps[0] + len(steps)))


def test_resume_in_its_own_directory_or_from_a_copy_of_its_last_pt_still_works(tmp_path):
    a = tmp_path / "a"
    train(config_from_dict(_raw(a)))
    copy = tmp_path / "backup.pt"
    shutil.copy(a / "last.pt", copy)
    res = train(config_from_dict(_raw(a, epochs=3)), resume=copy)  # the same bytes: the same run
    assert res.epochs_completed == 3
    # it continued: the log holds one unbroken run, no step trained twice
    assert [r["step"] for r in read_log(a, type="step")] == list(range(1, res.iteration + 1))
    res = train(config_from_dict(_raw(a, epochs=4)), resume=a / "last.pt")
    assert res.epochs_completed == 4
    assert [r["step"] for r in read_log(a, type="step")] == list(range(1, res.iteration + 1))
    # an empty directory takes any checkpoint, and starts after its last step
    done = ck.load_checkpoint(a / "last.pt")["iteration"]
    res = train(config_from_dict(_raw(tmp_path / "fresh", epochs=5)), resume=a / "last.pt")
    assert res.epochs_completed == 5
    assert [r["step"] for r in read_log(tmp_path / "fresh", type="step")] == list(range(done + 1, res.iteration + 1))


def test_a_killed_save_s_temporaries_are_removed_at_the_next_start(tmp_path):
    a = tmp_path / "a"
    train(config_from_dict(_raw(a)))
    dead, live = _dead_pid(), os.getppid()
    stale = [a / f".last.pt.{dead}.k3j2h1.tmp", a / f".log.jsonl.{dead}.tmp", a / f".best.pt.{dead}.x.tmp"]
    kept = [a / f".last.pt.{live}.zz9.tmp", a / ".last.pt.untaggedNEW.tmp"]
    old_untagged = a / ".last.pt.untaggedOLD.tmp"
    for p in stale + kept + [old_untagged]:
        p.write_bytes(b"half a checkpoint")
    old = time.time() - STALE_UNTAGGED_S - 60
    os.utime(old_untagged, (old, old))
    train(config_from_dict(_raw(a, epochs=3)), resume=a / "last.pt")
    assert [p.name for p in stale + [old_untagged] if p.exists()] == []
    assert all(p.exists() for p in kept)  # a live process's file, or a fresh one without a PID


def test_checkpoint_temporaries_carry_the_writer_s_pid(tmp_path, monkeypatch):
    seen = []
    real = os.replace

    def spy(src, dst):
        seen.append(os.path.basename(src))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    ck.save_checkpoint({"model": {}, "config": {}}, tmp_path / "last.pt")
    assert seen and seen[0].startswith(f".last.pt.{os.getpid()}.") and seen[0].endswith(".tmp")


def test_a_run_that_fails_while_it_is_built_leaves_no_empty_run_directory(tmp_path, capsys):
    """A bad model option fails after the run directory is made (the names are checked before,
    the values when the model is built): the directory it made is removed again; one that was
    already there (empty) is kept, as the user made it."""
    raw = _raw(tmp_path / "new" / "run")
    raw["model"]["options"]["embedding_dim"] = 2.5
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert cli.main(["train", str(path)]) == 2
    assert "embedding_dim must be" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # nor the parent folder it made
    (tmp_path / "mine").mkdir()
    raw["train"]["out_dir"] = str(tmp_path / "mine")
    with pytest.raises(ValueError, match="embedding_dim must be"):
        train(config_from_dict(raw))
    assert (tmp_path / "mine").is_dir()
