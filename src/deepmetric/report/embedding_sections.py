"""The sections of a run report about its embeddings: Recall@K (beside the logged baselines),
the cosine histograms of same- and different-class pairs (heated-up Fig. 4), the 2-d
embedding (Fig. 2) with the gradient norm against alpha (Fig. 1), the retrieval grids (random
and worst queries), per-class Recall@1, and a classifier's misclassified test images beside
their nearest training image (two-head paper Sec. 4.3). Each writes into a
:class:`~deepmetric.report.run_sections.Report`."""
from __future__ import annotations

import math

import numpy as np

from . import diagnostics as dg
from . import gradient_norm
from . import page as pg
from . import plots
from .run_inputs import image_source_for
from .run_sections import Report, format_value

__all__ = ["embedding_sections"]

_ALPHAS = np.geomspace(0.25, 256, 61)


def embedding_sections(report: Report, data: dict[str, np.ndarray], source: str, *, max_pairs: int, seed: int,
                       ks: tuple[int, ...], cfg=None, cfg_note: str = "", split: str | None = None,
                       images: bool = True, n_queries: int = 8, top_k: int = 8,
                       baselines: list[dict] | None = None, search_device=None) -> None:
    """Every section about the embeddings ``data`` (an embeddings ``.npz``'s arrays), which
    came from ``source``; ``cfg``: the run's config, to show the images behind the rows."""
    x = data["embeddings"]
    y = dg._as_labels(data["labels"], len(x))
    head = (f"{source}: {x.shape[0]} x {x.shape[1]}, {len(np.unique(y))} classes")
    report.md += [f"## Embeddings ({head})", ""]
    src, img_note, names = _images_and_names(data, y, cfg, cfg_note, split=split, images=images)
    _recall_section(report, data, head, ks=ks, cfg=cfg, baselines=baselines, search_device=search_device)
    _cosine_section(report, data, max_pairs=max_pairs, seed=seed)
    _embedding_section(report, data, names, seed=seed)
    _retrieval_sections(report, data, src, img_note, names, seed=seed, n_queries=n_queries, top_k=top_k,
                        search_device=search_device)
    if data.get("predictions", data.get("logits")) is not None:
        _classification_section(report, data, src, names, cfg, images=images, n_queries=n_queries,
                                search_device=search_device)


def _images_and_names(data, y, cfg, cfg_note: str, *, split, images: bool):
    """The images behind the rows (for the grids; None with a note why not) and the class names."""
    src, img_note = None, "images not shown (--no-images)"
    if images and cfg is not None:
        src, img_note = image_source_for(cfg, y, has_gallery=data.get("is_query") is not None, split=split)
    elif images:
        img_note = f"images not shown: {cfg_note}"
    names = src.class_names if src is not None else None
    if names is None and "class_names" in data:
        names = [str(n) for n in data["class_names"]]
    return src, img_note, names


def _recall_section(report: Report, data, head: str, *, ks, cfg, baselines, search_device) -> None:
    """Recall@K (after the run's search post-processing) beside the logged baselines' (epoch-0
    model, raw pixels, ...); K limited by the number of references a query can retrieve."""
    x = data["embeddings"]
    y = dg._as_labels(data["labels"], len(x))
    is_q, is_g = data.get("is_query"), data.get("is_gallery")
    n_ref = int(np.sum(is_g)) if is_g is not None else len(x) - 1
    ks_ok = tuple(k for k in ks if k <= n_ref)
    body = [f"<p>{pg.esc(head.replace('`', ''))}</p>"]
    if ks_ok:
        steps = list(getattr(getattr(cfg, "search", None), "postprocess", None) or [])
        rc = dg.recall_curve(x, y, ks_ok, is_query=is_q, is_gallery=is_g, device=search_device, postprocess=steps)
        if steps:  # the run's search.postprocess, as every search of this embedding applies it
            from deepmetric.evaluate.postprocess import format_steps

            body.append(f"<p>Recall@K after the run's post-processing: {pg.esc(format_steps(steps))}.</p>")
            report.md += [f"Recall@K after the run's post-processing: {format_steps(steps)}.", ""]
        base = {}
        for b in baselines or []:
            c = {int(k[7:]): float(v) for k, v in b["metrics"].items()
                 if k.startswith("recall@") and k[7:].isdigit() and int(k[7:]) in rc}
            if c and b["text"] not in base:
                base[b["text"]] = c
        plots.plot_recall_curve({"this run": rc, **base}, report.out / "recall_at_k.png")
        report.figures.append(("Recall@K", "recall_at_k.png"))
        report.md += ["| " + " | ".join(f"R@{k}" for k in rc) + " |", "|---" * len(rc) + "|",
                      "| " + " | ".join(format_value(v) for v in rc.values()) + " |", ""]
        body.append(pg.metrics_table(
            [{"label": "this run", "split": None, "kind": "eval",
              "metrics": {f"recall@{k}": v for k, v in rc.items()}}]
            + [{"label": pg.esc(name), "split": None, "kind": "baseline",
                "metrics": {f"recall@{k}": v for k, v in c.items()}} for name, c in base.items()],
            table_id="recall-table"))
        body.append(pg.figure(report.out / "recall_at_k.png", "Recall@K (%), K on a log2 axis", "Recall@K"))
    report.html.add("recall", "Recall@K", "\n".join(body), "Recall@K")


def _cosine_section(report: Report, data, *, max_pairs: int, seed: int) -> None:
    """Cosine similarity of same- and different-class pairs (heated-up Fig. 4): the test split's,
    and the training split's when the embeddings hold it."""
    x = data["embeddings"]
    y = dg._as_labels(data["labels"], len(x))
    hists = {"test": dg.pair_cosine_histograms(x, y, max_pairs=max_pairs, seed=seed)}
    if "train_embeddings" in data:
        xtr = data["train_embeddings"]
        ytr = dg._as_labels(data["train_labels"], len(xtr), "train_labels")
        hists = {"train": dg.pair_cosine_histograms(xtr, ytr, max_pairs=max_pairs, seed=seed), **hists}
    plots.plot_cosine_histograms(hists, report.out / "cosine_histograms.png")
    report.figures.append(("cosine similarity of pairs (heated-up Fig. 4)", "cosine_histograms.png"))
    report.md += ["Cosine similarity of pairs (mean, %s):" % ("exact" if all(h["exact"] for h in hists.values())
                                                              else "sampled"), "",
                  "| split | same class | different class | gap |", "|---|---|---|---|"]
    cos_rows = []
    for name, h in hists.items():
        mid = (h["edges"][:-1] + h["edges"][1:]) / 2
        ms = float(mid @ h["same"] / h["same"].sum()) if h["same"].sum() else math.nan
        mdf = float(mid @ h["diff"] / h["diff"].sum()) if h["diff"].sum() else math.nan
        report.md.append(f"| {name} | {ms:.3f} | {mdf:.3f} | {ms - mdf:.3f} |")
        cos_rows.append(f"<tr><th>{pg.esc(name)}</th><td>{ms:.3f}</td><td>{mdf:.3f}</td><td>{ms - mdf:.3f}</td></tr>")
    report.md.append("")
    report.html.add("cosine", "Cosine similarity of pairs (heated-up Fig. 4)",
                    '<table><thead><tr><th>split</th><th>same class</th><th>different class</th>'
                    '<th>gap</th></tr></thead><tbody>' + "".join(cos_rows) + "</tbody></table>"
                    + pg.figure(report.out / "cosine_histograms.png", "normalised histograms of the cosine "
                                "similarity of same-class (red) and different-class (blue) pairs",
                                "cosine histograms"), "cosine")


def _embedding_section(report: Report, data, names, *, seed: int) -> None:
    """The 2-d embedding coloured by class (heated-up Fig. 2) and, with the trained classifier's
    weights and training embeddings, the gradient norm against alpha of its samples (Fig. 1)."""
    x = data["embeddings"]
    y = dg._as_labels(data["labels"], len(x))
    if x.shape[1] < 2:  # one number per image: nothing to scatter (it was an error ending the report)
        emb_body = ['<p class="note">a 1-d embedding: no 2-d picture</p>']
    else:
        plots.plot_embedding_2d(x, y, report.out / "embedding_2d.png", seed=seed, normalize=x.shape[1] > 2,
                                class_names=names)
        report.figures.append(("embedding (heated-up Fig. 2 style)", "embedding_2d.png"))
        emb_body = [pg.figure(report.out / "embedding_2d.png", "2-d embedding coloured by class (PCA of the "
                              "l2-normalised embedding when it has more than 2 dimensions)", "2-d embedding")]
    if "class_weights" in data and "train_embeddings" in data:
        w = data["class_weights"]
        xtr, ytr = data["train_embeddings"], dg._as_labels(data["train_labels"], len(data["train_embeddings"]))
        picked = gradient_norm.select_paper_samples(xtr, ytr, w)
        curves = {}
        for kind, i in picked.items():
            if i is not None:
                curves[kind] = gradient_norm.gradient_norm_vs_alpha(xtr[i:i + 1], ytr[i:i + 1], _ALPHAS, weights=w)[0]
        if curves:
            plots.plot_grad_norm_vs_alpha(_ALPHAS, curves, report.out / "grad_norm_alpha.png")
            report.figures.append(("gradient norm vs alpha (heated-up Fig. 1)", "grad_norm_alpha.png"))
            report.md += ["Fig. 1 samples (training split): " + ", ".join(f"{k} = #{v}" for k, v in picked.items()),
                          ""]
            emb_body.append(pg.figure(report.out / "grad_norm_alpha.png", "gradient norm w.r.t. the "
                                      "normalised embedding against alpha (heated-up Fig. 1)",
                                      "gradient norm vs alpha"))
    report.html.add("embedding", "Embedding", "\n".join(emb_body), "embedding")


def _retrieval_sections(report: Report, data, src, img_note: str, names, *, seed: int, n_queries: int,
                        top_k: int, search_device) -> None:
    """Retrieval grids (random queries, and the worst: fewest correct in the top ``top_k``) and
    the best and worst classes by Recall@1."""
    x = data["embeddings"]
    y = dg._as_labels(data["labels"], len(x))
    is_q, is_g = data.get("is_query"), data.get("is_gallery")
    ex = dg.retrieval_examples(x, y, k=top_k, n_random=n_queries, n_worst=n_queries, seed=seed,
                               is_query=is_q, is_gallery=is_g, device=search_device)
    note = f'<p class="note">{pg.esc(img_note)}. Green border: same class as the query; red: another class.</p>'
    report.html.add("grids", f"Retrieval: random queries and their top-{top_k}",
                    note + _grid_html(ex, "random", y, names, src, "grid-random"), "random queries")
    report.html.add("worst", f"Retrieval: worst queries (fewest correct in the top-{top_k})",
                    note + _grid_html(ex, "worst", y, names, src, "grid-worst"), "worst queries")
    pcr = dg.per_class_recall(x, y, k=1, is_query=is_q, is_gallery=is_g, device=search_device)
    cls_html, cls_md = _per_class_html(pcr, names, src, y, is_q)
    report.html.add("classes", "Per-class Recall@1", cls_html, "per class")
    report.md += cls_md


def _classification_section(report: Report, data, src, names, cfg, *, images: bool, n_queries: int,
                            search_device) -> None:
    """A classifier's accuracy and, with training embeddings, its misclassified test images
    beside their nearest training image (two-head paper Sec. 4.3, Fig. 10)."""
    x = data["embeddings"]
    y = dg._as_labels(data["labels"], len(x))
    p = np.asarray(data.get("predictions", data.get("logits")))
    p = p.argmax(axis=1) if p.ndim == 2 else p.astype(np.int64)
    acc = float(np.mean(p == y))
    per_class = [float(np.mean(p[y == c] == c)) for c in np.unique(y)]
    report.md += ["## Classification", "", f"- top-1 accuracy {format_value(acc)} %, mean per-class "
                  f"{format_value(float(np.mean(per_class)))} %", ""]
    body = [f"<p>top-1 accuracy <b>{format_value(acc)} %</b>, mean per-class "
            f"{format_value(float(np.mean(per_class)))} %</p>"]
    if "train_embeddings" in data:
        res = dg.misclassified_neighbours(data["train_embeddings"], data["train_labels"], x, y, p,
                                          device=search_device)
        line = (f"{res['n_misclassified']} of {res['n_test']} test images misclassified; "
                f"their nearest training image carries the **predicted** label for "
                f"{format_value(res['share_neighbour_is_predicted'])} % and the true label for "
                f"{format_value(res['share_neighbour_is_true'])} % (two-head paper: 79.34 % "
                f"predicted, Flowers-102)")
        report.md += [f"- {line}", ""]
        body.append(f'<p id="misclassified-share">{pg.esc(line).replace("**predicted**", "<b>predicted</b>")}</p>')
        tr_src = None
        if images and cfg is not None and src is not None:
            tr_src, _ = image_source_for(cfg, dg._as_labels(data["train_labels"], len(data["train_labels"])),
                                         has_gallery=False, train=True)
        body.append(_pairs_html(res, names, src, tr_src, limit=2 * n_queries))
    report.html.add("classification", "Classification: misclassified test images (two-head Fig. 10)",
                    "\n".join(body), "misclassified")


def _class_name(names: list[str] | None, c: int) -> str:
    return names[c] if names is not None and 0 <= c < len(names) else str(c)



def _tile(row: int, kind: str, caption: str, src, label: int, alt: str) -> str:
    uri = src.thumbnail(int(row)) if src is not None else None
    img = (f'<img src="{uri}" alt="{pg.esc(alt)}">' if uri is not None
           else f'<span class="noimg">no image<br>#{row}</span>')
    return (f'<figure class="tile {kind}" data-row="{row}" data-label="{label}">'
            f'<div class="img">{img}</div><figcaption>{caption}</figcaption></figure>')


def _grid_html(ex: dict, which: str, y: np.ndarray, names, src, grid_id: str) -> str:
    rows = []
    for q in ex[which]:
        yq = int(y[q])
        tiles = [_tile(q, "query", f"query #{q}<br><b>{pg.esc(_class_name(names, yq))}</b>", src, yq,
                       f"query {q}"), '<div class="sep"></div>']
        for r, (n, s, c) in enumerate(zip(ex["neighbours"][q], ex["similarity"][q], ex["correct"][q])):
            if n < 0:
                continue
            yn = int(y[n])
            mark = "&#10003;" if c else "&#10007;"
            tiles.append(_tile(int(n), "hit" if c else "miss",
                               f"<b>{mark} {r + 1}</b> {pg.esc(_class_name(names, yn))}<br>cos {s:.3f}",
                               src, yn, f"rank {r + 1} of query {q}"))
        rows.append(f'<div class="row" data-query="{q}" data-label="{yq}" '
                    f'data-correct="{ex["n_correct"][q]}">' + "".join(tiles) + "</div>")
    return f'<div class="grid" id="{grid_id}">' + "\n".join(rows) + "</div>"


def _per_class_html(pcr: dict, names, src, y: np.ndarray, is_q) -> tuple[str, list[str]]:
    cls, rec, nq = pcr["classes"], pcr["recall"], pcr["n_queries"]
    order = np.lexsort((cls, -rec))  # best first, ties by class id
    m = min(10, max(1, len(cls) // 2)) if len(cls) > 1 else 1
    best, worst = order[:m], order[::-1][:m]
    q_rows = np.flatnonzero(np.ones(len(y), bool) if is_q is None else np.asarray(is_q, bool))

    def table(idx, tid: str, title: str) -> str:
        out = [f'<table id="{tid}"><caption>{title}</caption><thead><tr><th>class</th>'
               f'<th>example</th><th>queries</th><th>Recall@1 (%)</th></tr></thead><tbody>']
        for i in idx:
            c = int(cls[i])
            ex_row = int(q_rows[np.argmax(y[q_rows] == c)])
            uri = src.thumbnail(ex_row) if src is not None else None
            img = f'<img src="{uri}" alt="class {c}" style="height:40px">' if uri else ""
            out.append(f"<tr><th>{pg.esc(_class_name(names, c))}</th><td>{img}</td>"
                       f"<td>{int(nq[i])}</td><td>{100 * rec[i]:.1f}</td></tr>")
        return "".join(out) + "</tbody></table>"

    zero = int(np.sum(rec == 0))
    head = (f"<p>{len(cls)} query classes; Recall@1 per class: mean {100 * rec.mean():.1f} %, "
            f"median {100 * np.median(rec):.1f} %, {zero} classes at 0 %.</p>")
    html = (head + '<div style="display:flex;gap:24px;flex-wrap:wrap">'
            + table(best, "best-classes", f"best {len(best)} classes")
            + table(worst, "worst-classes", f"worst {len(worst)} classes") + "</div>")
    md = ["Per-class Recall@1 (best / worst classes):", "", "| class | queries | R@1 (%) |", "|---|---|---|"]
    md += [f"| {_class_name(names, int(cls[i]))} | {int(nq[i])} | {100 * rec[i]:.1f} |" for i in best]
    md += ["| ... | | |"] + [f"| {_class_name(names, int(cls[i]))} | {int(nq[i])} | {100 * rec[i]:.1f} |"
                             for i in worst[::-1]] + [""]
    return html, md


def _pairs_html(res: dict, names, te_src, tr_src, limit: int) -> str:
    pairs = []
    for j in range(min(limit, res["n_misclassified"])):
        t, n = int(res["misclassified"][j]), int(res["neighbour"][j])
        yt, yp, yn = int(res["true"][j]), int(res["predicted"][j]), int(res["neighbour_label"][j])
        test_tile = _tile(t, "miss", f"test #{t}<br>true <b>{pg.esc(_class_name(names, yt))}</b><br>"
                                     f"pred {pg.esc(_class_name(names, yp))}", te_src, yt, f"test {t}")
        kind = "pred" if yn == yp else "query"
        nb_tile = _tile(n, kind, f"nearest train #{n}<br><b>{pg.esc(_class_name(names, yn))}</b>"
                                 + (" (= predicted)" if yn == yp else ""), tr_src, yn, f"train {n}")
        pairs.append(f'<div class="pair" data-test="{t}" data-neighbour-is-predicted="{int(yn == yp)}">'
                     f"{test_tile}{nb_tile}</div>")
    if not pairs:
        return '<p class="note">nothing misclassified</p>'
    return ('<p class="note">each pair: a misclassified test image (red) and its nearest training '
            'image; orange when that image carries the predicted label.</p>'
            f'<div class="pairs" id="misclassified">{"".join(pairs)}</div>')
