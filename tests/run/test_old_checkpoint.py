"""A checkpoint written before the run/ layer (issue 31) still loads and gives the same
embeddings. tests/fixtures/checkpoint_before_run_layer/ was made once at ec54f98 (the last commit
before the refactor): a 1-epoch glyph_resnet (8-d) on the synthetic digit folder, its last.pt, 15
of its test-half images and the embeddings ``deepmetric embed`` gave them then."""
from pathlib import Path

import numpy as np

from deepmetric.cli import main

OLD = Path(__file__).parents[1] / "fixtures" / "checkpoint_before_run_layer"


def test_checkpoint_from_before_the_run_layer_embeds_identically(tmp_path):
    out = tmp_path / "emb.npz"
    rc = main(["embed", str(OLD / "last.pt"), "--root", str(OLD / "images"), "--split", "test",
               "--device", "cpu", "--out", str(out)])
    assert rc == 0
    now, then = np.load(out), np.load(OLD / "embeddings.npz")
    rel = [str(Path(p).relative_to((OLD / "images").resolve())) for p in now["paths"]]
    assert rel == list(then["paths"])
    np.testing.assert_array_equal(now["labels"], then["labels"])
    np.testing.assert_allclose(now["embeddings"], then["embeddings"], rtol=0, atol=1e-6)
