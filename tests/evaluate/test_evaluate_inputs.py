"""Bad input to deepmetric.evaluate gives clear errors (never a crash inside faiss/torch)."""
import numpy as np
import pytest
import torch

from deepmetric.evaluate import classification_accuracy, evaluate, kmeans, knn, nmi_from_clusters


@pytest.fixture
def data(rng):
    y = np.repeat(np.arange(5), 4)
    return rng.standard_normal((20, 8)).astype(np.float32), y


@pytest.mark.parametrize("backend", ["faiss", "torch"])
def test_nan_inf_rows_named(data, backend):
    x, y = data
    for bad in (np.nan, np.inf):
        x2 = x.copy()
        x2[7, 3] = bad
        with pytest.raises(ValueError, match="NaN or infinite.*row 7"):
            evaluate(x2, y, backend=backend)


def test_zero_vector_rejected(data):
    x, y = data
    x[4] = 0
    with pytest.raises(ValueError, match="all-zero row.*row 4"):
        evaluate(x, y)


def test_mismatched_lengths(data):
    x, y = data
    with pytest.raises(ValueError, match="labels has length 19 but embeddings have 20"):
        evaluate(x, y[:-1])
    with pytest.raises(ValueError, match=r"is_query must have shape \(20,\)"):
        evaluate(x, y, is_query=np.ones(5, bool))


def test_non_integer_labels(data):
    x, y = data
    for bad in (y.astype(np.float64), y.astype(str), y > 2):
        with pytest.raises(TypeError, match="labels must be integers"):
            evaluate(x, bad)
    with pytest.raises(TypeError, match="is_gallery must be a boolean"):
        evaluate(x, y, is_gallery=np.ones(20, int))


def test_single_class(data):
    x, _ = data
    with pytest.raises(ValueError, match="single class"):
        evaluate(x, np.zeros(20, np.int64))


def test_empty_sets(data):
    x, y = data
    with pytest.raises(ValueError, match="empty"):
        evaluate(np.zeros((0, 8), np.float32), np.zeros(0, np.int64))
    with pytest.raises(ValueError, match="query set is empty"):
        evaluate(x, y, is_query=np.zeros(20, bool))
    with pytest.raises(ValueError, match="gallery set is empty"):
        evaluate(x, y, is_gallery=np.zeros(20, bool))


def test_bad_shapes_and_options(data):
    x, y = data
    with pytest.raises(ValueError, match="2-D"):
        evaluate(x[0], y[:1])
    with pytest.raises(ValueError, match="unknown metric"):
        evaluate(x, y, metrics=["recal"])
    with pytest.raises(ValueError, match="positive integer"):
        evaluate(x, y, ks=(0, 1))
    with pytest.raises(ValueError, match="unknown backend"):
        evaluate(x, y, backend="annoy")
    with pytest.raises(ValueError, match="chunk_size"):
        evaluate(x, y, chunk_size=0)
    with pytest.raises(ValueError, match="memory_mb"):
        evaluate(x, y, memory_mb=-1)
    with pytest.raises(ValueError, match="dimension"):
        knn(x, x[:, :4], k=2)
    with pytest.raises(ValueError, match="n_clusters"):
        kmeans(x, 50)
    with pytest.raises(ValueError, match="average"):
        nmi_from_clusters(y, y, average="max")


def test_torch_and_numpy_inputs_agree(data):
    x, y = data
    assert evaluate(torch.from_numpy(x), torch.from_numpy(y)) == evaluate(x, y)
    assert evaluate(x.astype(np.float64), y) == pytest.approx(evaluate(x, y))


def test_queries_without_positive_are_excluded_and_counted(data):
    x, y = data
    y = y.copy()
    y[0] = 42  # a class of one: in all-vs-all mode it has no other positive
    with pytest.warns(UserWarning, match="1 query has no same-label"):
        res = evaluate(x, y, metrics=["recall"], ks=(1, 100))
    assert res["queries_without_positive"] == 1
    assert res["recall@100"] == 1.0  # every remaining query finds its positive eventually


def test_classification_bad_input():
    with pytest.raises(ValueError, match="labels has length 2 but embeddings have 3"):
        classification_accuracy(np.zeros((3, 2)), [0, 1])
    with pytest.raises(TypeError, match="predictions must be integers"):
        classification_accuracy(np.array([0.5, 1.0]), [0, 1])
    with pytest.raises(ValueError, match="NaN"):
        classification_accuracy(np.array([[np.nan, 1.0]]), [0])
