"""How a command ends when the user or the shell ends it (new-user trial): Ctrl-C ends every
command with one line and exit code 130 (serve printed asyncio's traceback and exited -2; index
--add torch's), an index's temporary folder still removed and the index left as it was; a
standard output closed by its reader (``search ... | head -3``) ends quietly (it printed
``error: [Errno 32] Broken pipe``); deepmetric's own warnings are one ``note:`` line each, not
Python's ``file:line: UserWarning`` and the source line."""
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from deepmetric import cli
from search_data import shapes_setup

SRC = Path(__file__).parents[2] / "src"


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return shapes_setup(tmp_path_factory)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1", "DEEPMETRIC_DEBUG": ""}


# --------------------------------------------------------------------------- Ctrl-C
@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["from_a_terminal", "a_scripts_background_job"])
def test_ctrl_c_stops_serve_with_one_line_and_exit_code_130(shapes, sigint_ignored):
    """Also when started as a script's background job (SIGINT inherited ignored): uvicorn stops
    on SIGINT either way, and before the fix that stop ended with exit 0 and no line (seen in CI
    when the suite itself ran as a background job)."""
    from serving import request, serve_subprocess

    with serve_subprocess(shapes["index_dir"], sigint_ignored=sigint_ignored) as (url, proc, output):  # 127.0.0.1
        assert request(url, "GET", "/api/info", timeout=10)[0] == 200
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
        out = output()
    assert rc == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert out.strip().splitlines()[-1] == "deepmetric serve: interrupted"


def test_ctrl_c_during_index_add_is_one_line_and_leaves_the_index_as_it_was(shapes, tmp_path, monkeypatch, capsys):
    import deepmetric.search.build as build

    out = tmp_path / "index"
    shutil.copytree(shapes["index_dir"], out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    extra = tmp_path / "extra"
    shutil.copytree(shapes["queries"], extra)
    real = build.embed_dataset_for_index
    reached = []

    def embed_then_ctrl_c(*args, **kwargs):  # Ctrl-C once the new images are embedded (and copied)
        real(*args, **kwargs)
        reached.append(sorted(p.name for p in tmp_path.iterdir()))
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "embed_dataset_for_index", embed_then_ctrl_c)
    try:
        rc = cli.main(["index", str(shapes["checkpoint"]), "--data", "folder", "--root", str(extra),
                       "--out", str(out), "--add", "--no-progress"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped deepmetric's main() (a traceback on the command line)")
    err = capsys.readouterr().err
    assert rc == 130
    assert err == f"deepmetric index: interrupted; {out} was left as it was (an index is replaced only once complete)\n"
    assert any(n.startswith(".index.tmp-") for n in reached[0])  # the transaction's folder existed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["extra", "index"]  # and is removed
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


# --------------------------------------------------------------------------- closed standard output
def test_a_closed_stdout_ends_search_quietly(shapes):
    """``deepmetric search ... | head -3``: the reader is gone before the results are printed."""
    query = sorted(Path(shapes["queries"]).glob("*/*.png"))[0]
    proc = subprocess.Popen([sys.executable, "-m", "deepmetric.cli", "search", str(shapes["index_dir"]), str(query),
                             "--k", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    proc.stdout.close()  # as head does once it has its lines
    try:
        err = proc.stderr.read().decode()
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert err == "" and rc == 141, (rc, err)


# --------------------------------------------------------------------------- warnings
@pytest.fixture(scope="module")
def loose_root(shapes, tmp_path_factory):
    """The shapes folder with two images directly in it (the folder dataset warns of them)."""
    root = tmp_path_factory.mktemp("loose") / "photos"
    shutil.copytree(shapes["folder"], root)
    for name in ("loose_a.png", "loose_b.png"):
        shutil.copy(next(root.glob("*/*.png")), root / name)
    return root


def test_deepmetric_warnings_are_one_note_line_on_the_command_line(shapes, loose_root, tmp_path):
    """The folder dataset's warning (raised with stacklevel into data/registry.py) is one
    ``note:`` line, without Python's ``registry.py:N: UserWarning`` and the source line."""
    proc = subprocess.run([sys.executable, "-m", "deepmetric.cli", "index", str(shapes["checkpoint"]), "--data",
                           "folder", "--root", str(loose_root), "--out", str(tmp_path / "index"), "--no-progress"],
                          capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stderr.splitlines() if "loose_a.png" in line] == [
        f"deepmetric index: note: folder: 2 images directly in '{loose_root}' (e.g. loose_a.png) are ignored: "
        "only images inside class folders are used"], proc.stderr
    assert "UserWarning" not in proc.stderr and "return ImageListDataset" not in proc.stderr


def test_other_libraries_warnings_keep_pythons_form_and_pytest_warns_still_sees_them(shapes, loose_root,
                                                                                    tmp_path):
    from deepmetric.data import folder

    fmt = cli._note_format("index", warnings.formatwarning)
    assert fmt("m", UserWarning, folder.__file__, 3) == "deepmetric index: note: m\n"
    other = str(Path(warnings.__file__).with_name("site-packages") / "torch" / "x.py")
    assert fmt("m", UserWarning, other, 3, "code") == warnings.formatwarning("m", UserWarning, other, 3, "code")
    saved = warnings.formatwarning
    with pytest.warns(UserWarning, match="folder: 2 images directly in"):  # recorded, as before
        assert cli.main(["index", str(shapes["checkpoint"]), "--data", "folder", "--root", str(loose_root),
                         "--out", str(tmp_path / "index"), "--no-progress"]) == 0
    assert warnings.formatwarning is saved  # put back when the command ends
