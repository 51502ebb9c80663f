"""``deepmetric tune CHECKPOINT --postprocess``: choose a finished checkpoint's retrieval
post-processing on its validation split, without training (docs/search.md, "Post-processing").

The validation split (``data.val_classes``) is embedded once; :func:`deepmetric.evaluate.
postprocess_choice.choose_postprocess` then searches the steps in seconds on the validation
metric: the run's cross-domain MAP@R when it evaluates cross-domain (``eval.cross_domain``), else
MAP@R. Nothing of the test split is read. Writes ``OUT/postprocess.yaml`` (a ``search:`` block
to paste into the recipe, or give as ``--postprocess`` to ``deepmetric index``) and
``OUT/postprocess_trials.json`` (every tried list with its validation value and seconds).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from deepmetric.run.rundir import write_text_atomic

__all__ = ["tune_postprocess", "validation_embeddings"]

TEST_SPLITS = ("test", "query", "gallery", "query+gallery")


def validation_embeddings(model, cfg, *, split: str = "val", device="cpu", batch_size: int | None = None,
                          output: str | None = None) -> dict:
    """``{"embeddings", "labels", "domains"}`` of ``split`` (the test transform; ``domains``
    None unless the run evaluates cross-domain and the split has domains). ``output``: the
    run's ``eval.embedding`` by default (what its index holds: the projection head's output for
    ``projection``); ``"features"`` gives the backbone's pooled features instead."""
    import torch

    from deepmetric.run.builders import build_split
    from deepmetric.run.embed import compute_embeddings, dataset_domains

    if split in TEST_SPLITS:
        raise ValueError(f"post-processing is chosen on validation, never on the test split; got split {split!r} "
                         "(use the validation classes of data.val_classes: split val)")
    if split == "val" and getattr(cfg.data, "val_classes", None) is None:
        raise ValueError("the checkpoint's run has no validation split (data.val_classes is not set): the "
                         "post-processing cannot be chosen without one; train with data.val_classes: 0.1")
    ds = build_split(cfg, split, train=False)
    with torch.no_grad():
        r = compute_embeddings(model, ds, batch_size=batch_size or cfg.eval.batch_size, device=device,
                               output=output or cfg.eval.embedding)
    dom = dataset_domains(ds) if cfg.eval.cross_domain else None
    return {"embeddings": r["embeddings"], "labels": r["labels"], "domains": None if dom is None else dom[0]}


def tune_postprocess(checkpoint: str | Path, *, split: str = "val", metric: str | None = None,
                     out: str | Path | None = None, device: str = "auto", batch_size: int | None = None,
                     kreciprocal: bool = False) -> dict:
    """Choose the post-processing of ``checkpoint`` on ``split`` (module docstring); returns the
    choice (validation numbers only) and writes it under ``out`` (default: beside the checkpoint)."""
    from deepmetric.evaluate.postprocess_choice import choose_postprocess
    from deepmetric.run.device import resolve_device
    from deepmetric.run.embed import load_model_from_checkpoint

    checkpoint = Path(checkpoint)
    if not checkpoint.is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint} not found (expected last.pt / best.pt of 'deepmetric train')")
    dev = resolve_device(device, name="--device")
    model, _, cfg, _ = load_model_from_checkpoint(checkpoint, dev)
    t0 = time.perf_counter()
    v = validation_embeddings(model, cfg, split=split, device=dev, batch_size=batch_size)
    t_embed = time.perf_counter() - t0
    cross = v["domains"] is not None
    metric = metric or ("cross_domain_map@r" if cross else "map@r")
    if metric.startswith("cross_domain_") and not cross:
        raise ValueError(f"--metric {metric}: the run does not evaluate cross-domain (eval.cross_domain) "
                         "or its validation split has no domains")
    res = choose_postprocess(v["embeddings"], v["labels"], domains=v["domains"], metric=metric,
                             ks=tuple(cfg.eval.ks), kreciprocal=kreciprocal)
    res.update({"checkpoint": str(checkpoint), "split": split, "images": int(len(v["labels"])),
                "embed_seconds": round(t_embed, 1)})
    out = Path(out) if out is not None else checkpoint.parent / "postprocess"
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "postprocess_trials.json", json.dumps(res, indent=1) + "\n")
    header = (f"# chosen on the validation split ({split}, {res['images']} images) of {checkpoint}: {metric} "
              f"{100 * res['value']:.2f} (without post-processing {100 * res['baseline']:.2f}); no test metric was read\n")
    write_text_atomic(out / "postprocess.yaml", header + yaml.safe_dump({"search": {"postprocess": res["steps"]}},
                                                             sort_keys=False))
    res["files"] = {"yaml": str(out / "postprocess.yaml"), "trials": str(out / "postprocess_trials.json")}
    return res
