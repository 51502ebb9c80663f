"""GPU speed of what only a GPU shows: mixed precision, channels_last and the torch k-NN path.

Part ``train``: training steps per second of the paper recipes' models on CUDA, for every
``train.amp`` (none / bf16 / fp16) x ``train.channels_last`` (off / on), the way
``deepmetric.train`` runs them (``autocast_context`` from deepmetric.run.device, the fp16
``GradScaler``, the model and the batch in channels_last memory format). Per model: a random
batch already on the GPU (no loader: this is the model's ceiling), cross-entropy on the
model's logits (the losses cost nothing next to the backbones), SGD with momentum. After
``--warmup`` steps, ``--steps`` steps are timed together (one ``cuda.synchronize`` at each end),
so images/s = steps x batch / time. Also reported: peak GPU memory of a step and the first
step's loss relative to fp32 from the same weights and batch (what autocast changes).

Part ``knn``: ``deepmetric.evaluate`` Recall@{1,10,100,1000} + MAP@R on SOP-sized synthetic
embeddings (bench/eval_speed.py's ``sop_like``: 60,502 x 128, 11,316 classes) with the
embeddings as a CUDA tensor (backend ``torch`` on the GPU, by ``memory_mb`` tile budget)
against the same arrays on the CPU (backend ``faiss``, ``--threads`` threads); the metrics
must agree. Then 20,000 queries against a 1,000,000 x 128 gallery (Recall@1 / MAP@R), both
backends.

Part ``eval`` (not in the default parts: it trains): the same emoji run (``--eval-recipe``,
default the demo's recipe at 64 px with an evaluation every epoch, one before training and the
cross-vendor metrics) trained twice on the GPU, once with its evaluations searching on the GPU
(``eval.device=auto``) and once on the CPU (``eval.device=cpu``): the evaluations' seconds
(``eval_seconds`` of log.jsonl: embedding and search), the run's wall time, and the largest
metric difference between the two (the evaluation before training compares the searches
alone: same weights, same embeddings).

    python bench/gpu_speed.py --out bench/results/gpu_speed.json           # train + knn
    python bench/gpu_speed.py --parts knn --threads 16
    python bench/gpu_speed.py --models efficientnet_lite0 --steps 20        # one model
    python bench/gpu_speed.py --parts eval --eval-out /tmp/gpu_eval         # GPU vs CPU evaluation

Needs a CUDA device; numbers are committed in bench/RESULTS.md with the device's name.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from deepmetric.models import create_model
from deepmetric.run.device import autocast_context

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_speed import sop_like  # noqa: E402  (same synthetic SOP as the CPU benchmark)

# (model name, create_model options, input size, batch): the recipes' backbones at their sizes.
MODELS = {
    # heated-up paper, Table 1 (recipes/heated): GoogLeNet, 224 px, batch 32, 64-d BN embedding
    "googlenet": ({"embedding_dim": 64, "norm": "bn"}, 224, 32),
    # two-head paper (recipes/two_head): ResNet-50 / DenseNet-161 two-head models, 224 px, batch 32
    "two_head_resnet50": ({"backbone": "resnet50", "embedding_dim": 256, "norm": "l2", "input_size": 224}, 224, 32),
    "two_head_densenet161": ({"backbone": "densenet161", "embedding_dim": 256, "norm": "l2", "input_size": 224}, 224, 32),
    # emoji study (studies/emoji.yaml): EfficientNet-Lite0, 64 px, batch 64, first 3 stages frozen
    "efficientnet_lite0": ({"embedding_dim": 64, "norm": "bn", "freeze_stages": 3}, 64, 64),
}
NUM_CLASSES = 100


def _sync():
    if torch.cuda.is_available():  # (the functions also run on the CPU, for the tests)
        torch.cuda.synchronize()


def _peak_mib(device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")


def _reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def train_speed(name: str, amp: str, channels_last: bool, steps: int, warmup: int, device,
                batch: int | None = None) -> dict:
    options, size, recipe_batch = MODELS[name]
    batch = batch or recipe_batch
    torch.manual_seed(0)
    model_name = "two_head" if name.startswith("two_head") else name
    model = create_model(model_name, num_classes=NUM_CLASSES, **options).to(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(batch, 3, size, size, generator=g).to(device)
    y = torch.randint(0, NUM_CLASSES, (batch,), generator=g).to(device)
    if channels_last:  # as deepmetric.train: the model once, each batch as it arrives
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda", enabled=(amp == "fp16"))
    model.train()

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast_context(device, amp):
            loss = torch.nn.functional.cross_entropy(model(x)["logits"].float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    first_loss = step().item()  # from the seed-0 weights: what autocast changes in one forward
    for _ in range(warmup - 1):
        step()
    _sync()
    _reset_peak(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync()
    dt = time.perf_counter() - t0
    return {"model": name, "size": size, "batch": batch, "amp": amp, "channels_last": channels_last,
            "images_per_s": steps * batch / dt, "ms_per_step": 1000 * dt / steps,
            "peak_mem_mib": _peak_mib(device), "first_loss": first_loss}


def knn_speed(threads: int, repeats: int, device) -> list[dict]:
    import faiss

    from deepmetric.evaluate import evaluate

    faiss.omp_set_num_threads(threads)
    rng = np.random.default_rng(0)
    x, y = sop_like(rng)
    rows = []

    def timed(fn):
        times, out = [], None
        for _ in range(repeats):
            _sync()
            t0 = time.perf_counter()
            out = fn()
            _sync()
            times.append(time.perf_counter() - t0)
        return out, min(times)

    kw = {"ks": (1, 10, 100, 1000), "metrics": ("recall", "map@r")}
    ref, t_cpu = timed(lambda: evaluate(x, y, backend="faiss", **kw))
    rows.append({"set": "SOP-sized 60,502 x 128", "backend": f"faiss (CPU, {threads} threads)", "s": t_cpu,
                 "max_abs_diff": 0.0, **ref})
    xg = torch.from_numpy(x).to(device)
    for mb in (256, 4096):
        _reset_peak(device)
        got, t = timed(lambda mb=mb: evaluate(xg, y, backend="torch", memory_mb=mb, **kw))
        diff = max(abs(got[k] - ref[k]) for k in ref)
        rows.append({"set": "SOP-sized 60,502 x 128", "backend": f"torch (GPU), memory_mb {mb}", "s": t,
                     "peak_mem_mib": _peak_mib(device),
                     "max_abs_diff": diff, **got})

    # 1M gallery, 20k queries (In-shop style masks: the queries are not in the gallery)
    n, nq, d = 1_000_000, 20_000, 128
    centres = rng.standard_normal((10_000, d)).astype(np.float32)
    labels = rng.integers(0, 10_000, n)
    big = centres[labels] + 1.4 * rng.standard_normal((n, d)).astype(np.float32)
    is_query = np.zeros(n, bool)
    is_query[rng.choice(n, nq, replace=False)] = True
    kw = {"ks": (1,), "metrics": ("recall", "map@r"), "is_query": is_query, "is_gallery": ~is_query}
    ref, t_cpu = timed(lambda: evaluate(big, labels, backend="faiss", **kw))
    rows.append({"set": "20,000 queries x 980,000 gallery, 128-d", "backend": f"faiss (CPU, {threads} threads)",
                 "s": t_cpu, "max_abs_diff": 0.0, **ref})
    bg = torch.from_numpy(big).to(device)
    for mb in (256, 8192):
        _reset_peak(device)
        got, t = timed(lambda mb=mb: evaluate(bg, labels, backend="torch", memory_mb=mb, **kw))
        rows.append({"set": "20,000 queries x 980,000 gallery, 128-d", "backend": f"torch (GPU), memory_mb {mb}",
                     "s": t, "peak_mem_mib": _peak_mib(device),
                     "max_abs_diff": max(abs(got[k] - ref[k]) for k in ref), **got})
    return rows


#: ``--parts eval``: the demo's emoji run at 64 px (its cache file, 36 MB, can be carried to a machine
#: without the npm packages), evaluated every epoch and before training, with the cross-vendor metrics
EVAL_RECIPE = "recipes/demo_emoji.yaml"
EVAL_OVERRIDES = ["data.options={size: 64}", "eval.every=1", "eval.at_start=true", "eval.cross_domain=true",
                  "train.num_threads=null", "train.progress=false"]


def eval_device_runs(recipe: str, overrides: list[str], out_dir: Path, devices=("auto", "cpu")) -> list[dict]:
    """Train ``recipe`` once per ``eval.device`` in ``devices`` (same seed, same everything else)
    and return per run: the evaluations (count, seconds in all and per evaluation, from the
    ``eval_seconds`` of log.jsonl), the wall time of the whole run, and every evaluation's
    metrics (``evals``: ``(split, epoch) -> metrics``)."""
    from deepmetric.run import rundir
    from deepmetric.train.loop import train_from_config_file

    rows = []
    for device in devices:
        out = Path(out_dir) / f"eval_{device}"
        t0 = time.perf_counter()
        train_from_config_file(recipe, [*overrides, f"eval.device={device}", f"train.out_dir={out}"], overwrite=True)
        wall = time.perf_counter() - t0
        evals = rundir.read_log(out, type="eval")
        seconds = [float(r["eval_seconds"]) for r in evals]
        keep = ("type", "split", "epoch", "step", "eval_seconds", "alpha")
        rows.append({"eval_device": device, "wall_s": wall, "evaluations": len(evals), "eval_s": sum(seconds),
                     "eval_s_each": sum(seconds) / max(1, len(seconds)),
                     "evals": {(r["split"], r["epoch"]): {k: v for k, v in r.items() if k not in keep}
                               for r in evals}})
    return rows


def metric_differences(a: dict, b: dict) -> tuple[float, float]:
    """``(largest |difference| of the evaluation before training, largest over every evaluation)``
    between two :func:`eval_device_runs` rows (NaN where an evaluation or metric is missing)."""
    def diff(keys):
        d = [abs(a["evals"][k][m] - b["evals"][k][m]) for k in keys if k in a["evals"] and k in b["evals"]
             for m in a["evals"][k] if m in b["evals"][k]]
        return max(d) if d else float("nan")

    first = [k for k in a["evals"] if k[1] == 0]
    return diff(first), diff(list(a["evals"]))


def _eval_table(rows: list[dict]) -> str:
    out = ["| eval.device | evaluations | eval s (all) | s per evaluation | run wall s | max diff before training "
           "| max diff, all evaluations |", "|---|---|---|---|---|---|---|"]
    ref = next((r for r in rows if r["eval_device"] == "cpu"), rows[0])
    for r in rows:
        d0, d_all = metric_differences(r, ref)
        out.append(f"| {r['eval_device']} | {r['evaluations']} | {r['eval_s']:.2f} | {r['eval_s_each']:.3f} "
                   f"| {r['wall_s']:.1f} | {d0:.1e} | {d_all:.1e} |")
    return "\n".join(out)


def _train_table(rows: list[dict]) -> str:
    out = ["| model | px | batch | amp | channels_last | img/s | ms/step | x fp32 | peak MiB | first loss - fp32 |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    base = {r["model"]: r for r in rows if r["amp"] == "none" and not r["channels_last"]}
    for r in rows:
        b = base.get(r["model"])
        out.append(f"| {r['model']} | {r['size']} | {r['batch']} | {r['amp']} | {'yes' if r['channels_last'] else 'no'} "
                   f"| {r['images_per_s']:.0f} | {r['ms_per_step']:.1f} | {r['images_per_s'] / b['images_per_s']:.2f} "
                   f"| {r['peak_mem_mib']:.0f} | {r['first_loss'] - b['first_loss']:+.1e} |")
    return "\n".join(out)


def _knn_table(rows: list[dict]) -> str:
    out = ["| set | backend | s | peak GPU MiB | recall@1 | map@r | max abs diff vs faiss |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        mem = f"{r['peak_mem_mib']:.0f}" if "peak_mem_mib" in r else "-"
        out.append(f"| {r['set']} | {r['backend']} | {r['s']:.2f} | {mem} | {r['recall@1']:.4f} | {r['map@r']:.4f} "
                   f"| {r['max_abs_diff']:.1e} |")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", default=["train", "knn"], choices=["train", "knn", "eval"])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--amp", nargs="+", default=["none", "bf16", "fp16"], choices=["none", "bf16", "fp16"])
    ap.add_argument("--batch", type=int, default=None, help="batch size for every model (default: each recipe's)")
    ap.add_argument("--steps", type=int, default=50, help="timed training steps per setting")
    ap.add_argument("--warmup", type=int, default=10, help="untimed training steps first (cudnn autotune)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads of the faiss side")
    ap.add_argument("--repeats", type=int, default=1, help="k-NN repeats (the fastest is kept)")
    ap.add_argument("--eval-recipe", default=EVAL_RECIPE, help=f"the run of --parts eval (default {EVAL_RECIPE})")
    ap.add_argument("--eval-set", nargs="*", default=[], metavar="KEY=VALUE",
                    help=f"more overrides for --parts eval (after {' '.join(EVAL_OVERRIDES)})")
    ap.add_argument("--eval-out", type=Path, default=Path("runs/gpu_eval"),
                    help="run directories of --parts eval (eval_auto/, eval_cpu/; replaced)")
    ap.add_argument("--out", type=Path, help="write every row as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_speed.py: no CUDA device (torch.cuda.is_available() is False)")
    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True  # fixed shapes: let cudnn pick its kernels, as a user would
    result = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "cuda": torch.version.cuda, "cpus": os.cpu_count(), "python": platform.python_version(),
              "argv": sys.argv[1:], "train": [], "knn": [], "eval": []}
    print(f"# {result['device']}, torch {result['torch']} (CUDA {result['cuda']}), {result['cpus']} CPUs", flush=True)
    if "train" in args.parts:
        for name in args.models:
            for amp in args.amp:
                for cl in (False, True):
                    r = train_speed(name, amp, cl, args.steps, args.warmup, device, args.batch)
                    result["train"].append(r)
                    print(json.dumps(r), flush=True)
                    torch.cuda.empty_cache()
        print(_train_table(result["train"]), flush=True)
    if "knn" in args.parts:
        result["knn"] = knn_speed(args.threads, args.repeats, device)
        print(_knn_table(result["knn"]), flush=True)
    if "eval" in args.parts:
        rows = eval_device_runs(args.eval_recipe, EVAL_OVERRIDES + list(args.eval_set), args.eval_out)
        print(_eval_table(rows), flush=True)
        result["eval"] = [{**r, "evals": [{"split": k[0], "epoch": k[1], **v} for k, v in r["evals"].items()]}
                          for r in rows]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
