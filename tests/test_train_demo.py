"""The offline demo end to end in --quick mode (a few glyph classes rendered into tmp)."""
import json

from deepmetric import cli


def test_demo_quick_writes_checkpoint_metrics_and_plots(tmp_path, capsys):
    out = tmp_path / "demo"
    assert cli.main(["demo", "--quick", "--out", str(out), f"data.root={tmp_path / 'cache'}",
                     "train.progress=false"]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "demo_metrics.json").read_text())
    for phase in ("before_heat_up", "after_heat_up"):
        for k in ("recall@1", "recall@2", "recall@4", "recall@8", "nmi"):
            assert 0.0 <= summary[phase][k] <= 1.0
        r = [summary[phase][f"recall@{k}"] for k in (1, 2, 4, 8)]
        assert r == sorted(r)  # Recall@K is monotone in K
    assert summary["before_heat_up"]["alpha"] == 16.0 and summary["after_heat_up"]["alpha"] == 4.0
    for name in ("last.pt", "config.yaml", "log.jsonl", "training_curves.png", "cosine_histograms.png",
                 "recall_curve.png"):
        assert (out / name).is_file(), name
        assert str(out / name) in printed or name in ("config.yaml", "log.jsonl")
    heat = [json.loads(l) for l in (out / "log.jsonl").read_text().splitlines() if '"heat_up"' in l]
    assert len(heat) == 1 and heat[0]["alpha"] == [4.0]
