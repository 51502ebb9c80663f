"""bench/study_claims.py: the verdict of each paper claim from study results, against
hand-computed paired t intervals."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("study_claims", ROOT / "bench" / "study_claims.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["study_claims"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _write(root, study, values):
    """values: {variant: [recall@1 per seed]} (map@r = recall@1 / 2)."""
    rows = [{"benchmark": "", "variant": v, "seed": s, "final/recall@1": x, "final/map@r": x / 2}
            for v, xs in values.items() for s, x in enumerate(xs) if x is not None]
    (root / study).mkdir(parents=True)
    (root / study / "results.json").write_text(json.dumps({"rows": rows}))


def test_verdicts_against_hand_computed_intervals(tmp_path):
    sc = _module()
    _write(tmp_path, "glyphs_cross_family", {
        "alpha16": [0.70, 0.71, 0.72],
        "alpha4": [0.68, 0.68, 0.68],     # d = 2, 3, 4 points: mean 3, sd 1, t(0.975, 2) = 4.3027
        "alpha8": [0.72, 0.73, 0.74],     # d = -2 -2 -2 +- 0: sd 0 -> interval is the point -2: reversed
        "alpha32": [0.60, 0.80, 0.70],    # d = 10, -9, 2: contains 0
        "alpha64": [0.69, None, None],    # one pair: pending
    })
    rows = sc.load_rows("glyphs_cross_family", tmp_path)
    st = sc.paired(rows, "alpha16", "alpha4", "final/recall@1")
    half = 4.302652729911275 * 0.01 / 3 ** 0.5
    assert st["n"] == 3 and st["mean"] == pytest.approx(0.03)
    assert (st["ci_low"], st["ci_high"]) == pytest.approx((0.03 - half, 0.03 + half))
    assert sc.verdict(st) == "holds"
    assert sc.verdict(sc.paired(rows, "alpha16", "alpha8", "final/recall@1")) == "reversed"
    assert sc.verdict(sc.paired(rows, "alpha16", "alpha32", "final/recall@1")) == "not resolved"
    assert sc.verdict(sc.paired(rows, "alpha16", "alpha64", "final/recall@1")) == "pending"
    text = sc.render(tmp_path)
    assert (f"| glyphs_cross_family | alpha16 - alpha4 | final/recall@1 | +3.00 [{100 * (0.03 - half):+.2f}, "
            f"{100 * (0.03 + half):+.2f}] (n=3) | holds |") in text
    assert "| glyphs_cross_family | alpha16 - alpha64 | final/recall@1 | +1.00 (n=1) | pending |" in text
    # the alpha-16 claim: one check reversed -> does not hold; a study with no results -> pending
    assert "| alpha 16 is the best fixed temperature (vs 4, 8, 32, 64) | heated-up softmax, Table 3 | " \
           "does not hold (reversed in at least one check) |" in text
    assert "two-head hard / semi-hard > softmax in classification accuracy | two-head, Tables 1-2 | pending |" in text


def test_claim_verdict_combinations():
    sc = _module()
    assert sc.claim_verdict(["holds", "holds"]) == "holds"
    assert sc.claim_verdict(["holds", "pending"]) == "holds so far (checks pending)"
    assert sc.claim_verdict(["holds", "not resolved"]) == "not resolved"
    assert sc.claim_verdict(["pending"]) == "pending"
    assert sc.claim_verdict(["holds", "reversed", "pending"]).startswith("does not hold")


def test_reevaluated_metrics_join_their_runs(tmp_path):
    sc = _module()
    _write(tmp_path, "fashion_mnist_two_head", {"semihard": [0.90, 0.91, 0.92], "softmax": [0.90, 0.90, 0.90]})
    again = [{"benchmark": None, "variant": v, "seed": s, "final/nmi": x}
             for v, xs in {"semihard": [0.85, 0.86, 0.84], "softmax": [0.82, 0.83, 0.84]}.items()
             for s, x in enumerate(xs)]
    (tmp_path / "fashion_mnist_two_head" / "reevaluated_kmeans10.json").write_text(json.dumps({"rows": again}))
    rows = sc.load_rows("fashion_mnist_two_head", tmp_path)
    semi1 = next(r for r in rows if r["variant"] == "semihard" and r["seed"] == 1)
    assert semi1["final/nmi[kmeans10]"] == 0.86 and semi1["final/recall@1"] == 0.91
    st = sc.paired(rows, "semihard", "softmax", "final/nmi[kmeans10]")
    assert st["n"] == 3 and st["mean"] == pytest.approx(0.02)  # d = 3, 3, 0 points
    assert "| fashion_mnist_two_head | semihard - softmax | final/nmi[kmeans10] | +2.00 [" in sc.render(tmp_path)


def test_the_fair_comparison_claims_name_its_losses():
    """Every emoji_fair check compares two losses of the fair comparison's table (a misspelt
    variant would stay 'pending' for ever)."""
    mod = _module()
    spec = importlib.util.spec_from_file_location("emoji_fair_table", ROOT / "studies" / "emoji_fair.py")
    fair = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fair)
    checks = [ch for c in mod.CLAIMS for ch in c.checks if ch.study == mod.EF]
    assert len(checks) == 2 * (4 + 2 + 4)
    for ch in checks:
        assert ch.a in fair.LOSSES and ch.b in fair.LOSSES, ch
        assert ch.metric in ("final/cross_domain_recall@1", "final/cross_domain_map@r")


def test_a_claims_caveat_is_printed_under_its_verdict_only(tmp_path, monkeypatch):
    mod = _module()
    _write(tmp_path, "s", {"A": [0.5, 0.6, 0.7], "B": [0.4, 0.45, 0.5]})
    checks = mod._each("s", [("A", "B")], ("final/recall@1",))
    monkeypatch.setattr(mod, "CLAIMS", (mod.Claim("k1", "paper 1", "A > B", checks, caveat="B was not tuned"),
                                        mod.Claim("k2", "paper 2", "A > B again", checks)))
    text = mod.render(tmp_path)
    first, second = text.split("## A > B again")
    assert first.rstrip().endswith("**Verdict: holds.**\n\nCaveat: B was not tuned")
    assert "Caveat" not in second


def test_the_protocol_v2_verdicts_head_the_page_pending_until_its_final_step(tmp_path):
    """Before protocol v2's final step every pre-registered hypothesis is *pending*; then each row
    carries the verdict, budget, interval and Holm p that the protocol's summary wrote
    (verdicts.json from bench/protocol_v2.write_summary, not hand-made), above the v1 history."""
    sc = _module()
    text = sc.render(tmp_path)
    v2 = text.split("## Protocol v2")[1].split("## v1 (history)")[0]
    rows = [line for line in v2.splitlines() if line.startswith("| H")]
    assert [r.split("|")[1].strip() for r in rows] == ["H1", "H2", "H3", "H4", "H5a", "H5b", "H6"]
    assert all("**pending**" in r for r in rows) and "no test number of protocol v2 exists yet" in v2

    spec = importlib.util.spec_from_file_location("protocol_v2_bench_claims", ROOT / "bench" / "protocol_v2.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    runs, copy = tmp_path / "runs", tmp_path / "protocol_v2"
    results = [{"loss": loss, "seed": s, "completed_trials": 12, "optimizer": "sgd", "embedding": "own", "epochs": 10,
                "cross_domain_recall@1": base + d, "cross_domain_map@r": base / 2, "val_flattened": True}
               for loss, base in (("HBN", 0.60), ("BN", 0.50)) for s, d in zip(range(100, 105),
                                                                                [0.01, -0.01, 0.0, 0.005, -0.005])]
    bench.write_csv(runs / "results.csv", results, bench.RESULT_COLUMNS)
    proto = bench.Protocol(bench.parse_args(["--runs", str(runs), "--copy-to", str(copy)]))
    bench.write_summary(proto)
    bench.copy_results(proto)
    v2 = sc.render(tmp_path).split("## Protocol v2")[1].split("## v1 (history)")[0]
    h1 = [line for line in v2.splitlines() if line.startswith("| H1 |")][0]
    # every seed's difference is 10 points: (almost) no spread, the t statistic's limit p = 0, a point CI
    assert "cross_domain_recall@1: HBN - BN: +10.00 [+10.00, +10.00] (n=5)" in h1, h1
    assert "10 epochs, 12 completed tune trials per loss, seeds 100-104" in h1 and "**holds**" in h1
    assert "| HBN flattened 5/5, best.pt at a heated epoch 0/0, 5 unknown; BN flattened 5/5 |" in h1  # no best_epoch
    assert "cross_domain_map@r: HBN - BN: +5.00" in h1
    assert "**pending**" in [line for line in v2.splitlines() if line.startswith("| H2 |")][0]
    assert "Pending" not in v2.split("| id |")[0]


def test_the_control_is_read_beside_h6_against_each_losss_own_seeded_runs(tmp_path):
    """Under the v2 verdicts: the control (validation) against the losses' own seeded runs'
    validation values in results.csv; a loss counts only when its control run lies beyond every
    one of its own runs, and a pytorch-metric-learning loss among them words H6 as pre-registered
    (PREREGISTRATION.md, 2026-11-28, twelfth session)."""
    sc = _module()
    folder = tmp_path / "protocol_v2"
    folder.mkdir()
    assert "once the final step has written results.csv" in "\n".join(sc.control_note(tmp_path))
    (folder / "control.csv").write_text(
        "loss,seed,winner,tune_best_val,val_at_own_settings,val_at_winner_settings,val_map_at_own_settings,"
        "val_map_at_winner_settings,same_run\n"
        "HBN,100,HBN,0.62,0.60,0.60,0.3,0.3,True\n"
        "SM,100,HBN,0.57,0.53,0.38,0.29,0.18,False\n"
        "LN,100,HBN,0.53,0.52,0.54,0.27,0.33,False\n"            # within its runs' range: not counted
        "pml_arcface,100,HBN,0.41,0.41,0.55,0.18,0.30,False\n"
        "npair,100,HBN,0.49,0.48,,0.25,,False\n")                # no value: not counted
    (folder / "results.csv").write_text(
        "loss,seed,val_objective\n" + "".join(f"{loss},{seed},{v}\n" for loss, values in (
            ("HBN", (0.58, 0.61)), ("SM", (0.53, 0.55)), ("LN", (0.52, 0.55)), ("pml_arcface", (0.40, 0.41)),
            ("npair", (0.47, 0.48))) for seed, v in zip((100, 101), values)))
    assert sc.control_reading(tmp_path) == (["pml_arcface"], ["SM"])
    note = "\n".join(sc.control_note(tmp_path))
    assert "1 loss scores above every one of its own seeded runs there (pml_arcface), 1 below every one (SM)" in note
    assert "fell short for pml_arcface: a **holds** for H6 reads \"holds under 12-trial tunes" in note
    assert "| H6 |" in sc.render(tmp_path) and note.split("\n")[0] in sc.render(tmp_path)
    (folder / "control.csv").write_text(
        "loss,seed,winner,tune_best_val,val_at_own_settings,val_at_winner_settings,val_map_at_own_settings,"
        "val_map_at_winner_settings,same_run\nLN,100,HBN,0.53,0.52,0.60,0.27,0.33,False\n")
    note = "\n".join(sc.control_note(tmp_path))  # only one of ours above: no H6 wording
    assert "(LN)" in note and "H6 reads" not in note


def test_h4_is_read_beside_the_beta_sweep_at_equal_settings(tmp_path):
    """The sweep (almn_beta.csv) against beta 3 by seed, checked against hand-computed t intervals:
    beta 0 - beta 3 = (+0.01, -0.01, +0.03) points x 100 -> mean +1.00, sd 2.00, t(0.975, 2) = 4.303
    -> half-width 4.97; beta 1 - beta 3 = (+0.05, +0.06, +0.07) -> +6.00 +- 2.48 (above 0)."""
    sc = _module()
    assert sc.almn_sweep_note(tmp_path) == []  # before the final step: nothing
    folder = tmp_path / "protocol_v2"
    folder.mkdir()
    beta3 = (0.40, 0.42, 0.44)
    rows = {"almn_sweep_beta3": beta3,
            "almn_sweep_beta0": tuple(b + d for b, d in zip(beta3, (0.01, -0.01, 0.03))),
            "almn_sweep_beta1": tuple(b + d for b, d in zip(beta3, (0.05, 0.06, 0.07)))}
    (folder / "almn_beta.csv").write_text("loss,seed,cross_domain_recall@1\n" + "".join(
        f"{loss},{100 + i},{v}\n" for loss, vs in rows.items() for i, v in enumerate(vs)))
    note = "\n".join(sc.almn_sweep_note(tmp_path))
    assert "beta 0 - beta 3: +1.00 [-3.97, +5.97] (n=3)" in note
    assert "beta 1 - beta 3: +6.00 [+3.52, +8.48] (n=3)" in note
    assert "1 of 2 intervals contain 0" in note and "beta 3 42.00" in note
    assert note.split("\n")[0] in sc.render(tmp_path)


def test_the_glyph_analysis_is_said_to_have_no_result_only_once_the_verdicts_exist(tmp_path):
    sc = _module()
    folder = tmp_path / "protocol_v2"
    folder.mkdir()
    assert sc.glyph_note(tmp_path) == []  # no verdicts yet: the glyph runs may still come
    (folder / "verdicts.json").write_text("[]")
    assert "no result" in "\n".join(sc.glyph_note(tmp_path))
    (folder / "glyphs.csv").write_text("loss,seed\n")
    assert sc.glyph_note(tmp_path) == []
