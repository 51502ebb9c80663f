"""The GPU path end to end, checked where CI runs (no GPU): every decision of where a search
runs (``deepmetric evaluate / embed / index / report`` and in-training evaluation), the GPU's
code path (torch tensors and the torch backend) run on the CPU device against faiss, and the
evaluation loader's pinned memory."""
import json

import numpy as np
import pytest
import torch

from conftest import synthetic_config
from deepmetric import cli
from deepmetric.evaluate import choose_search_device, evaluate
from deepmetric.evaluate.knn import resolve_backend
from deepmetric.run.evaluation import command_search_device
from deepmetric.search.query import exact_search
from deepmetric.run import rundir
from deepmetric.train import train
from deepmetric.run.builders import build_split, build_model
from deepmetric.run.config import ConfigError
from deepmetric.run.config_io import config_from_dict
from deepmetric.run import embed as EMB
from deepmetric.run import evaluation as E

CPU = torch.device("cpu")


def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def fake_cuda(monkeypatch):
    """torch says CUDA is there (the decisions are taken without touching a GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


# --------------------------------------------------------------------------- the decision
def test_auto_search_device_follows_cuda_the_default_and_the_backend():
    assert choose_search_device("auto", cuda_available=False) == CPU
    assert choose_search_device("auto", cuda_available=True) == torch.device("cuda")
    assert choose_search_device("cpu", cuda_available=True) == CPU                  # cpu forces it
    assert choose_search_device("auto", default="cpu", cuda_available=True) == CPU  # a CPU model
    assert choose_search_device("auto", default="cuda:1", cuda_available=True) == torch.device("cuda", 1)
    for backend in ("faiss", "faiss-hnsw", "faiss-ivf"):  # CPU-only backends keep auto on the CPU
        assert choose_search_device("auto", backend=backend, cuda_available=True) == CPU
        assert choose_search_device("auto", default="cuda:0", backend=backend) == CPU
    assert choose_search_device("cuda:1", backend="torch", cuda_available=True) == torch.device("cuda", 1)


def test_auto_search_falls_back_to_the_cpu_when_the_embeddings_do_not_fit():
    seen = []

    def free(dev):
        seen.append(dev)
        return 1_000 * 2**20  # 1000 MiB free

    # 4 copies of 200 MiB + the 256 MiB tile budget > 1000 MiB: the CPU
    assert choose_search_device("auto", default="cuda:0", nbytes=200 * 2**20, free_bytes=free) == CPU
    assert seen == [torch.device("cuda", 0)]
    # 4 x 100 MiB + 256 MiB fits
    assert choose_search_device("auto", default="cuda:0", nbytes=100 * 2**20, free_bytes=free) == torch.device("cuda", 0)
    # an explicit request is not second-guessed, and the CPU needs no check
    assert choose_search_device("cuda", nbytes=2**40, cuda_available=True, free_bytes=free) == torch.device("cuda")
    assert choose_search_device("auto", default="cpu", nbytes=2**40, free_bytes=free) == CPU
    assert len(seen) == 2


def test_search_device_errors_name_the_flag(monkeypatch):
    no_cuda(monkeypatch)
    with pytest.raises(ValueError, match=r"--device cuda: CUDA is not available.*use --device cpu or auto"):
        choose_search_device("cuda")
    with pytest.raises(ValueError, match="--device cuda:0: CUDA is not available"):
        choose_search_device("cuda:0")
    with pytest.raises(ValueError, match=r"--backend faiss-hnsw searches on the CPU, but --device cuda"):
        choose_search_device("cuda", backend="faiss-hnsw", cuda_available=True)
    for bad in ("gpu", "cuda:x", "cpu:0", ""):
        with pytest.raises(ValueError, match=r"--device .*expected auto, cpu, cuda or cuda:INDEX"):
            choose_search_device(bad)
    with pytest.raises(ValueError, match="--backend 'annoy'"):
        choose_search_device("auto", backend="annoy")


def test_backend_auto_is_faiss_on_the_cpu_and_torch_on_any_other_device():
    assert resolve_backend("auto", np.zeros((2, 3), np.float32)) == "faiss"
    assert resolve_backend("auto", torch.zeros(2, 3)) == "faiss"
    assert resolve_backend("auto", torch.zeros(2, 3, device="meta")) == "torch"  # stands in for CUDA
    with pytest.raises(ValueError, match="runs on the CPU"):
        resolve_backend("faiss", torch.zeros(2, 3, device="meta"))


# --------------------------------------------------------------------------- in-training evaluation
def _cfg(tmp_path, **eval_keys):
    return config_from_dict(synthetic_config(tmp_path / "run", eval={"every": 1, **eval_keys}))


def test_eval_device_decides_the_in_training_search(tmp_path):
    auto, cpu = _cfg(tmp_path), _cfg(tmp_path, device="cpu")
    assert auto.eval.device == "auto"
    assert E.eval_search_device(auto, CPU) == CPU                      # a CPU run stays on the CPU
    assert E.eval_search_device(auto, "cuda:0") == torch.device("cuda", 0)  # a CUDA run searches there
    assert E.eval_search_device(cpu, "cuda:0") == CPU                   # eval.device: cpu forces faiss
    with pytest.raises(ConfigError, match=r"config key 'eval.device': expected one of 'auto', 'cpu', got 'cuda'"):
        _cfg(tmp_path, device="cuda")


def test_eval_search_on_a_gpu_without_room_goes_to_the_cpu(tmp_path, monkeypatch):
    import sys

    knn_module = sys.modules["deepmetric.evaluate.knn"]  # (deepmetric.evaluate.knn is also the function)
    monkeypatch.setattr(knn_module, "_cuda_free_bytes", lambda dev: 2**30)
    cfg = _cfg(tmp_path)
    assert E.eval_search_device(cfg, "cuda:0", nbytes=2**20) == torch.device("cuda", 0)
    assert E.eval_search_device(cfg, "cuda:0", nbytes=2**28) == CPU  # 4 x 256 MiB + tiles > 1 GiB


def _model_and_sets(tmp_path, **data):
    cfg = config_from_dict(synthetic_config(tmp_path / "run", classes=7, per_class=12,
                                            eval={"every": 1, "metrics": None, "ks": [1, 2, 4, 32]}, **data))
    torch.manual_seed(0)
    model = build_model(cfg, num_classes=7)
    return cfg, model, build_split(cfg, "test", train=False)


def test_evaluate_model_keeps_tensors_and_the_torch_path_equals_faiss(tmp_path, monkeypatch):
    """The GPU's code path on the CPU device: the embeddings stay torch tensors and the torch
    backend searches them; every metric equals faiss's on the same embeddings, and the old
    route (a numpy array from compute_embeddings straight into evaluate)."""
    cfg, model, ds = _model_and_sets(tmp_path)
    seen = []
    import deepmetric.evaluate as ev

    real = ev.evaluate

    def spy(x, *a, **kw):
        seen.append((type(x), getattr(x, "device", None), kw.get("backend")))
        return real(x, *a, **kw)

    monkeypatch.setattr(ev, "evaluate", spy)
    m_torch, emb_torch = E.evaluate_model(model, {"query": ds}, cfg, device=CPU, backend="torch")
    m_faiss, emb_faiss = E.evaluate_model(model, {"query": ds}, cfg, device=CPU, backend="faiss")
    assert seen == [(torch.Tensor, CPU, "torch"), (torch.Tensor, CPU, "faiss")]
    monkeypatch.setattr(ev, "evaluate", real)
    old = EMB.compute_embeddings(model, ds, batch_size=cfg.eval.batch_size)
    assert isinstance(old["embeddings"], np.ndarray)
    ref = evaluate(old["embeddings"], old["labels"], ks=(1, 2, 4, 32), seed=cfg.train.seed)
    assert set(m_torch) == set(ref) >= {"recall@1", "recall@32", "map@r", "r_precision", "nmi", "f1"}
    for k in ref:
        assert m_torch[k] == pytest.approx(ref[k], abs=1e-6), k
        assert m_faiss[k] == pytest.approx(ref[k], abs=1e-6), k
    # what the run keeps for plots stays numpy, identical to compute_embeddings'
    for emb in (emb_torch, emb_faiss):
        assert isinstance(emb["embeddings"], np.ndarray)
        np.testing.assert_array_equal(emb["embeddings"], old["embeddings"])
        np.testing.assert_array_equal(emb["labels"], old["labels"])


def test_query_gallery_evaluation_torch_path_equals_faiss(tmp_path):
    cfg, model, ds = _model_and_sets(tmp_path)
    half = len(ds) // 2  # every class in both halves
    q, g = torch.utils.data.Subset(ds, range(0, len(ds), 2)), torch.utils.data.Subset(ds, range(1, len(ds), 2))
    m_torch, emb = E.evaluate_model(model, {"query": q, "gallery": g}, cfg, device=CPU, backend="torch")
    m_faiss, _ = E.evaluate_model(model, {"query": q, "gallery": g}, cfg, device=CPU, backend="faiss")
    assert emb["is_query"].sum() == half and (emb["is_query"] ^ emb["is_gallery"]).all()
    assert m_torch.keys() == m_faiss.keys()
    for k in m_faiss:
        assert m_torch[k] == pytest.approx(m_faiss[k], abs=1e-6), k


def test_search_placement_moves_device_tensors_to_a_cpu_search():
    x = np.ones((3, 2), np.float32)
    assert E.place_for_search(x, CPU) is x                       # faiss reads the array
    t = torch.ones(3, 2)
    assert E.place_for_search(t, CPU) is t
    on_gpu = torch.ones(3, 2, device="meta")                      # stands in for a CUDA tensor
    with pytest.raises((NotImplementedError, RuntimeError), match="meta"):
        E.place_for_search(on_gpu, CPU)   # eval.device: cpu copies it to the host (meta cannot be)
    assert E.place_for_search(on_gpu, torch.device("meta")) is on_gpu
    moved = E.place_for_search(x, torch.device("meta"))           # an array bound for a GPU search
    assert isinstance(moved, torch.Tensor) and moved.device.type == "meta" and moved.shape == (3, 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, auto trains and searches there: not the CPU's search")
def test_a_run_with_eval_device_cpu_logs_the_same_metrics(tmp_path):
    """On a CPU machine ``auto`` and ``cpu`` are the same search: identical eval records."""
    records = {}
    for device in ("auto", "cpu"):
        raw = synthetic_config(tmp_path / device, eval={"every": 1, "device": device})
        train(config_from_dict(raw))
        evals = [r for r in rundir.read_log(tmp_path / device) if r["type"] == "eval"]
        records[device] = [{k: v for k, v in r.items() if k != "eval_seconds"} for r in evals]
    assert len(records["auto"]) == 3 and records["auto"] == records["cpu"]
    saved = (tmp_path / "cpu" / "config.yaml").read_text()
    assert "device: cpu" in saved


def test_raw_pixel_baseline_searched_for_a_cpu_run_equals_the_default(tmp_path, rng):
    from PIL import Image

    from deepmetric.data import build_dataset as build_data, build_transform
    from deepmetric.run.baselines import raw_pixel_baseline

    for c in range(3):
        (tmp_path / "d" / f"c{c}").mkdir(parents=True)
        base = rng.integers(0, 255, (6, 5, 3))
        for i in range(4):
            noisy = np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8)
            Image.fromarray(noisy).save(tmp_path / "d" / f"c{c}" / f"{i}.png")
    ds = build_data("folder", tmp_path / "d", split="all", transform=build_transform("mnist", train=False))
    cfg = _cfg(tmp_path, ks=[1, 2])
    a, desc_a = raw_pixel_baseline({"query": ds}, cfg)
    b, desc_b = raw_pixel_baseline({"query": ds}, cfg, device=CPU)
    assert a is not None and "recall@1" in a
    assert a == b and desc_a == desc_b


# --------------------------------------------------------------------------- pinned memory
def test_eval_loader_pins_memory_exactly_on_cuda(tmp_path, monkeypatch):
    _, model, ds = _model_and_sets(tmp_path)
    for device, pinned in (("cuda", True), ("cuda:1", True), (CPU, False), ("cpu", False)):
        loader = EMB.make_eval_loader(ds, batch_size=8, device=device, num_workers=0)
        assert loader.pin_memory is pinned, device
        assert not loader.persistent_workers  # one pass per evaluation: nothing to keep alive
    made = []
    real = EMB.make_eval_loader

    def spy(dataset, **kw):
        made.append(kw)
        return real(dataset, **kw)

    monkeypatch.setattr(EMB, "make_eval_loader", spy)
    out = EMB.compute_embeddings(model, ds, batch_size=8, device="cpu", as_tensor=True)
    assert made == [{"batch_size": 8, "device": CPU, "num_workers": 0}]
    assert isinstance(out["embeddings"], torch.Tensor) and out["embeddings"].device == CPU
    assert out["embeddings"].shape == (len(ds), 8) and out["embeddings"].dtype == torch.float32


# --------------------------------------------------------------------------- the commands
@pytest.fixture
def npz(tmp_path, rng):
    y = np.repeat(np.arange(6), 5)
    x = (np.eye(6)[y] * 2 + rng.normal(size=(30, 6))).astype(np.float32)
    path = tmp_path / "emb.npz"
    np.savez(path, embeddings=x, labels=y)
    return path


def test_evaluate_device_flag_parsing_and_decision(npz, tmp_path, capsys, monkeypatch):
    from deepmetric.evaluate.io import evaluate_cli_search_device

    parse = cli.build_parser().parse_args
    args = parse(["evaluate", str(npz)])
    assert args.device == "auto" and args.backend == "auto"
    assert evaluate_cli_search_device(args, cuda_available=False) == CPU
    assert evaluate_cli_search_device(args, cuda_available=True) == torch.device("cuda")
    assert evaluate_cli_search_device(parse(["evaluate", str(npz), "--device", "cpu"]), cuda_available=True) == CPU
    assert evaluate_cli_search_device(parse(["evaluate", str(npz), "--backend", "faiss"]), cuda_available=True) == CPU
    # the same metrics whichever device auto picks on this machine
    outs = {}
    for device in ("auto", "cpu"):
        assert cli.main(["evaluate", str(npz), "--device", device, "--out", str(tmp_path / f"{device}.json")]) == 0
        outs[device] = json.loads((tmp_path / f"{device}.json").read_text())
    assert outs["auto"] == outs["cpu"]
    capsys.readouterr()
    no_cuda(monkeypatch)
    assert cli.main(["evaluate", str(npz), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda: CUDA is not available" in err and "Traceback" not in err
    fake_cuda(monkeypatch)  # refused before anything touches the GPU
    assert cli.main(["evaluate", str(npz), "--device", "cuda", "--backend", "faiss-ivf"]) == 2
    assert "--backend faiss-ivf searches on the CPU, but --device cuda" in capsys.readouterr().err


def test_model_commands_device_and_search_device(tmp_path, monkeypatch):
    parse = cli.build_parser().parse_args
    for command in (["report", "RUN"], ["index", "CKPT", "--out", "IDX"]):
        args = parse(command)
        assert (args.device, args.search_device) == ("auto", "auto")
        args = parse(command + ["--device", "cuda:1", "--search-device", "cpu"])
        assert (args.device, args.search_device) == ("cuda:1", "cpu")
        with pytest.raises(SystemExit):
            parse(command + ["--search-device", "cuda"])  # the GPU comes from --device
    assert parse(["embed", "CKPT", "--out", "e.npz"]).device == "auto"
    for decide in (command_search_device,):  # report's and index's one decision
        no_cuda(monkeypatch)
        assert decide("auto", "auto") == CPU             # a CPU machine: faiss
        assert decide("cpu", "auto") == CPU
        with pytest.raises(ValueError, match=r"--device 'cuda' requested but CUDA is not available"):
            decide("cuda", "cpu")                        # checked even for a CPU search
        with pytest.raises(ValueError, match="--search-device 'gpu'"):
            decide("auto", "gpu")
        fake_cuda(monkeypatch)
        assert decide("auto", "auto") == torch.device("cuda", 0)   # the model's GPU searches
        assert decide("cuda:1", "auto") == torch.device("cuda", 1)
        assert decide("cuda", "cpu") == CPU                         # --search-device cpu
        assert decide("cpu", "auto") == CPU                         # a CPU model: faiss


@pytest.mark.parametrize("argv", [["embed", "nothing.pt", "--out", "e.npz", "--device", "cuda"],
                                  ["index", "nothing.pt", "--out", "idx", "--device", "cuda"]])
def test_model_commands_without_cuda_name_the_flag(argv, tmp_path, capsys, monkeypatch):
    no_cuda(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--device 'cuda' requested but CUDA is not available" in err and "Traceback" not in err
    assert not (tmp_path / "e.npz").exists() and not (tmp_path / "idx").exists()


def test_report_without_cuda_names_the_flag_before_any_work(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    train(config_from_dict(synthetic_config(run, train={"epochs": 1})))
    no_cuda(monkeypatch)
    assert cli.main(["report", str(run), "--device", "cuda"]) == 2
    assert "--device 'cuda' requested but CUDA is not available" in capsys.readouterr().err
    assert not (run / "report" / "report.html").exists()


def test_exact_search_torch_path_equals_faiss_with_ties(rng):
    g = rng.normal(size=(300, 16)).astype(np.float32)
    g[50:60] = g[5]  # exact duplicates: ties broken by the smaller row on both paths
    g /= np.linalg.norm(g, axis=1, keepdims=True)
    q = np.concatenate([g[:40], g[5:6]])
    s_f, i_f = exact_search(g, q, 15)
    s_t, i_t = exact_search(g, q, 15, backend="torch", memory_mb=0.05)  # the GPU's path, small tiles
    np.testing.assert_array_equal(i_t, i_f)
    np.testing.assert_allclose(s_t, s_f, atol=1e-6)
    assert list(i_f[-1, :11]) == [5] + list(range(50, 60))


def test_index_search_device_reaches_the_recall_measurement(rng, monkeypatch):
    import deepmetric.search.index as index_module

    calls = []
    real = index_module.recall_against_exact

    def spy(*a, **kw):
        calls.append(kw.get("device"))
        return real(*a, **kw)

    monkeypatch.setattr(index_module, "recall_against_exact", spy)
    x = rng.normal(size=(400, 8)).astype(np.float32)
    from deepmetric.search import Index

    ix = Index(x, kind="hnsw", search_device=CPU)
    ix.add(x[:5])
    assert calls == [CPU, CPU] and ix.search_device == CPU
    assert Index(x).search_device == "cpu"


# --------------------------------------------------------------------------- recipes
def test_recipes_at_batch_128_say_when_bf16_and_channels_last_pay_and_keep_float32():
    from pathlib import Path

    from deepmetric.run.config_io import load_config

    root = Path(__file__).resolve().parents[2] / "recipes"
    advised, plain = [], []
    for path in sorted(root.glob("*/*.yaml")):
        if path.parent.name == "vit":  # the modern ViT protocol trains in bf16 (test below)
            continue
        cfg = load_config(path)
        text = path.read_text()
        has = "train.amp=bf16 train.channels_last=true" in text
        (advised if cfg.train.batch_size >= 128 else plain).append((path, cfg, has))
    assert len(advised) >= 28 and all(has for _, _, has in advised)      # ALMN: GoogLeNet, m x n = 128-130
    assert not any(has for _, _, has in plain)                             # batch 32-63: AMP does not help
    for path, cfg, _ in advised:
        assert cfg.train.amp == "none" and not cfg.train.channels_last, path  # the settings stay the paper's
        if cfg.model.name == "googlenet":
            assert "1.6x the float32 speed of googlenet" in path.read_text()


def test_report_searches_where_it_decided(tmp_path, monkeypatch):
    """make_report takes one decision (command_search_device) for the embeddings it shows and
    hands it to every neighbour search of the page."""
    import deepmetric.report.run_report as rr
    from deepmetric.report import diagnostics as dg

    run = tmp_path / "run"
    train(config_from_dict(synthetic_config(run, train={"epochs": 1})))
    decided, searched = [], []
    real_decide = rr.command_search_device

    def decide(device, search_device, **kw):
        decided.append((device, search_device, kw.get("nbytes", 0)))
        return real_decide(device, search_device, **kw)

    monkeypatch.setattr(rr, "command_search_device", decide)
    for name in ("recall_curve", "retrieval_examples", "per_class_recall"):
        real = getattr(dg, name)

        def spy(*a, _name=name, _real=real, **kw):
            searched.append((_name, kw.get("device")))
            return _real(*a, **kw)

        monkeypatch.setattr(dg, name, spy)
    rr.make_report(run, device="cpu", search_device="auto", images=False, embed_train=False)
    n = len(build_split(config_from_dict(synthetic_config(run)), "test", train=False))
    assert decided[0] == ("cpu", "auto", 0)                 # checked before any work
    assert decided[1] == ("cpu", "auto", 4 * n * 8)         # then with the embeddings' size (n x 8 float32)
    assert sorted(searched) == [("per_class_recall", CPU), ("recall_curve", CPU), ("retrieval_examples", CPU)]


def test_vit_recipes_train_in_bf16_as_their_protocol_does():
    """recipes/vit/ (the modern ViT protocol, batch ~900) train in bf16 mixed precision, unlike the
    papers' float32 recipes above, which only advise it."""
    from pathlib import Path

    from deepmetric.run.config_io import load_config

    paths = sorted((Path(__file__).resolve().parents[2] / "recipes" / "vit").glob("*.yaml"))
    assert len(paths) == 6
    for path in paths:
        assert load_config(path).train.amp == "bf16", path
