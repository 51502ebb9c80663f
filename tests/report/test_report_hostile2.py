"""Second hostile trial of ``deepmetric report``: malformed run folders and embeddings give one
line naming the file, exit code 2, no traceback and no report folder; odd but valid input
(a 1-d embedding) still gives a report."""
import json

import numpy as np
import pytest

from deepmetric.cli import main
from deepmetric.report import make_report

LOG = [{"type": "step", "step": 1, "epoch": 1, "loss": 2.0, "lr": 0.1},
       {"type": "step", "step": 2, "epoch": 1, "loss": 1.5, "lr": 0.1},
       {"type": "eval", "epoch": 1, "step": 2, "split": "test", "recall@1": 0.5, "map@r": 0.2}]


def run_dir(tmp_path):
    """A run folder holding a short, valid log.jsonl."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in LOG))
    return run


def refused(capsys, run, *flags, expect: str) -> str:
    assert main(["report", str(run), "--device", "cpu", "--no-images", *flags]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert expect in err, err
    assert not (run / "report").exists()  # nothing written
    return err


@pytest.mark.parametrize("content,expect", [
    ("a: [unclosed\n  b: : :", "config.yaml: invalid YAML (expected ',' or ']', but got ':' at line 2, column 4)"),
    (b"\xff\xfe\x00\x01", "config.yaml: not a text file (invalid start byte at byte 0)"),
    ("- 1\n- 2\n", "config.yaml: expected the run's configuration (a YAML mapping such as 'data: ...'), got list"),
])
def test_a_config_that_is_not_one_is_named(tmp_path, capsys, content, expect):
    """Bad YAML was PyYAML's multi-line text, a binary file a codec error naming no file, and a
    list was shown as 'no config.yaml in the run directory'."""
    run = run_dir(tmp_path)
    (run / "config.yaml").write_bytes(content if isinstance(content, bytes) else content.encode())
    refused(capsys, run, expect=expect)


def test_a_binary_log_is_named(tmp_path, capsys):
    run = run_dir(tmp_path)
    (run / "log.jsonl").write_bytes(b"\x00\xff\xfe garbage")
    refused(capsys, run, expect="log.jsonl: not a text file of JSON lines (invalid start byte at byte 1)")


def test_bad_metrics_json_writes_no_report(tmp_path, capsys):
    """The error was right but the report folder was made before metrics.json was read."""
    run = run_dir(tmp_path)
    (run / "metrics.json").write_text("[1, 2, 3]")
    refused(capsys, run, expect="metrics.json: expected a JSON object, got list")


def emb(rng, n=60, d=8, classes=5):
    y = np.arange(n) % classes
    return (rng.normal(size=(classes, d))[y] + 0.3 * rng.normal(size=(n, d))).astype(np.float32), y


@pytest.mark.parametrize("arrays,expect", [
    (lambda x, y: dict(embeddings=x[:, 0], labels=y), "'embeddings' must be 2-D (N x d), got shape (60,)"),
    (lambda x, y: dict(embeddings=np.where(np.arange(60)[:, None] == 3, np.nan, x), labels=y),
     "'embeddings' contain NaN or infinite values in 1 row(s), first at row 3"),
    (lambda x, y: dict(embeddings=x, labels=np.zeros(60, int)), "every row has the same label"),
    (lambda x, y: dict(embeddings=x, labels=np.arange(60)), "no query has another row of its label"),
    (lambda x, y: dict(embeddings=x, labels=y.astype(str)), "'labels' must hold integers"),
    (lambda x, y: dict(embeddings=x, labels=y, is_query=np.zeros(60, bool)), "'is_query' selects no row"),
    (lambda x, y: dict(embeddings=x, labels=y, train_embeddings=x[:, :5], train_labels=y),
     "'train_embeddings' have 5 columns but 'embeddings' have 8"),
    (lambda x, y: dict(embeddings=x, labels=y, train_embeddings=x, train_labels=y, class_weights=np.ones((5, 3))),
     "'class_weights' must be (classes, 8) like the embeddings, got shape (5, 3)"),
])
def test_bad_embeddings_are_named_before_anything_is_written(tmp_path, capsys, rng, arrays, expect):
    """A 1-d 'embeddings' was an IndexError traceback; NaN, one class, string labels or a
    classifier of another width were errors naming no file, after figures were written."""
    run = run_dir(tmp_path)
    x, y = emb(rng)
    np.savez(run / "embeddings.npz", **arrays(x, y))
    refused(capsys, run, expect=f"{run / 'embeddings.npz'}: {expect}")


def test_one_dimensional_embedding_still_gets_a_report(tmp_path, rng):
    """d = 1 is a valid embedding (Recall@K, histograms, grids): only the 2-d picture is left
    out (it ended the report with 'cannot draw a 2-d scatter')."""
    run = run_dir(tmp_path)
    x, y = emb(rng, d=1)
    np.savez(run / "embeddings.npz", embeddings=x, labels=y)
    md = make_report(run, images=False)
    assert "a 1-d embedding: no 2-d picture" in (run / "report" / "report.html").read_text()
    assert "R@1" in md.read_text() and not (run / "report" / "embedding_2d.png").exists()


def test_warnings_are_one_line_notes(tmp_path, capsys, rng):
    """A truncated last log line was reported as Python's 'file.py:256: UserWarning' plus the
    source line."""
    run = run_dir(tmp_path)
    with open(run / "log.jsonl", "a") as f:
        f.write('{"type": "step", "st')
    assert main(["report", str(run), "--device", "cpu", "--no-embed"]) == 0
    err = capsys.readouterr().err.strip()
    assert err == f"deepmetric report: note: {run / 'log.jsonl'}:4: skipping truncated last line (Unterminated " \
                  "string starting at)"
