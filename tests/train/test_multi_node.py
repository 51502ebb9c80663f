"""Several machines (issue 32, item 18): two torchrun "nodes" on 127.0.0.1 (--nnodes 2,
--node_rank, --rdzv_endpoint, gloo on the CPU), each with its own train.out_dir: the run trains
on both, and only global rank 0 (node 0) writes the run's files, as docs/training.md says."""
import os
import subprocess
import sys
from pathlib import Path

import yaml

from conftest import free_port, synthetic_config

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_two_nodes_with_per_node_out_dirs_only_node_0_writes(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(synthetic_config(eval={"baselines": False}, train={"epochs": 2, "device": "cpu"})))
    port = free_port()
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--node_rank", str(node), "--rdzv_endpoint", f"127.0.0.1:{port}",
               "-m", "deepmetric.cli", "train", str(cfg), f"train.out_dir={tmp_path / f'node{node}' / 'run'}"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    node0 = tmp_path / "node0" / "run"
    assert {"config.yaml", "log.jsonl", "last.pt", "metrics.json"} <= {p.name for p in node0.iterdir()}
    assert not (tmp_path / "node1").exists() or not any((tmp_path / "node1").rglob("*"))
    assert "[deepmetric] done: 2 epochs" in outs[0] and "[deepmetric] done" not in outs[1]
