"""``deepmetric index`` under torchrun: 2 CPU processes (gloo) embed their shards and rank 0
builds the same index as one process; a rank killed with SIGKILL is survived by running the
same command again (finished shards are not embedded again)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from deepmetric.search import Index
from search_data import shapes_setup


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return shapes_setup(tmp_path_factory)


def _torchrun(shapes, out: Path, procs: int):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs),
            "-m", "deepmetric.cli", "index", str(shapes["checkpoint"]), "--out", str(out), "--shard-size", "2",
            "--approximate", "ivf", "--no-progress", "--device", "cpu", "--search-device", "cpu"]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _rank_pids(proc) -> dict:
    """``{rank: pid}`` of torchrun's workers (children whose environment has RANK)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            if int(stat[1]) != proc.pid:
                continue
            env = dict(e.split("=", 1) for e in open(f"/proc/{pid}/environ").read().split("\0") if "=" in e)
        except OSError:
            continue
        if "RANK" in env:
            out[int(env["RANK"])] = int(pid)
    return out


def test_two_ranks_build_the_one_process_index_and_survive_a_killed_rank(shapes, tmp_path):
    one = Index.load(shapes["index_dir"])  # built by one plain process
    out = tmp_path / "ix"
    proc = _torchrun(shapes, out, 2)
    deadline = time.monotonic() + 60
    pids, shard_files = {}, []
    while time.monotonic() < deadline and proc.poll() is None:  # kill rank 1 once it wrote a shard
        if 1 not in pids:  # torchrun may start rank 0 before rank 1: look again until both run
            pids = _rank_pids(proc)
        shard_files = sorted(tmp_path.glob(".ix.shards-*/shard-*.npy"))
        if 1 in pids and any(int(f.stem[-6:]) >= 8 for f in shard_files):
            os.kill(pids[1], signal.SIGKILL)
            break
        time.sleep(0.01)
    assert 1 in pids, proc.communicate()[0]
    log = proc.communicate(timeout=60)[0]
    assert proc.returncode != 0, log  # torchrun reports the lost worker and stops rank 0
    assert not out.exists()
    rank0_done = [f for f in tmp_path.glob(".ix.shards-*/shard-*.npy") if int(f.stem[-6:]) < 8]
    again = _torchrun(shapes, out, 2)  # the same command
    log = again.communicate(timeout=90)[0]
    assert again.returncode == 0, log
    assert not list(tmp_path.glob(".ix.shards-*"))  # rank 0 removed the shards once the index was written
    two = Index.load(out, verify_hashes=True)
    assert two.meta["data"]["images"] == 32 and list(two.paths) == list(one.paths)
    assert np.array_equal(two.labels, one.labels) and two.class_names == one.class_names
    assert np.abs(np.asarray(two.embeddings) - one.embeddings).max() < 1e-5
    assert two.kind == "ivf" and two.meta["approximate"]["recall@10_vs_exact"] == 1.0
    import json

    shards = json.loads((out / "manifest.json").read_text())  # what rank 0 did in the second run
    assert shards["shards"]["world_size"] == 2 and shards["shards"]["reused_by_rank_0"] == len(rank0_done)
    q = one.embeddings[:8]
    assert np.array_equal(two.search(q, k=5)[1], one.search(q, k=5)[1])


def test_embed_over_two_ranks_equals_one_process(shapes, tmp_path):
    from deepmetric import cli

    one = tmp_path / "one.npz"
    assert cli.main(["embed", str(shapes["checkpoint"]), "--split", "all", "--out", str(one), "--device", "cpu"]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    two = tmp_path / "two.npz"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "deepmetric.cli", "embed", str(shapes["checkpoint"]), "--split", "all", "--out", str(two),
                        "--device", "cpu", "--shard-size", "3"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    a, b = np.load(one), np.load(two)
    assert sorted(a.files) == sorted(b.files) == ["class_names", "embeddings", "labels", "paths"]
    assert np.abs(a["embeddings"] - b["embeddings"]).max() < 1e-5
    assert all(np.array_equal(a[k], b[k]) for k in ("labels", "paths", "class_names"))
    assert not list(tmp_path.glob(".two.npz.shards-*"))
