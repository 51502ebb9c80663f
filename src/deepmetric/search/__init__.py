"""Search with trained embeddings: build and keep an index of a gallery (``Index``), query it
with images or embeddings, export the embedding network (ONNX / TorchScript) and serve a
local search page. See docs/search.md.

Only :mod:`deepmetric.cli` imports this package; it imports nothing from the training loop at
import time.
"""
from .index import EmbeddingIndex, Index
from .query import Preprocessing, embed_images, load_image

__all__ = ["Index", "EmbeddingIndex", "Preprocessing", "embed_images", "load_image"]
