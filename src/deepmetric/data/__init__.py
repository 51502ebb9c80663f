"""deepmetric.data: dataset loaders, user data, samplers and transforms.

``build_dataset(name, root=None, split="train", transform=None, **options)`` builds every
dataset; ``list_datasets()`` names them and ``dataset_options(name)`` their options
(``list_transforms()`` / ``transform_options(name)`` for the transforms).  A dataset registers
its builder with ``register_dataset`` where it is defined; this package imports every such
module. See docs/data.md and docs/offline-data.md.
"""
from .contract import MetricDataset, MetricDatasetBase, batch_transform_of, with_dataset_defaults
from .decode import ImageDecodeError, ImageSizeError, decode_image
from .image_list import IMAGE_EXTENSIONS, ImageList, ImageListDataset, remap_labels
from .benchmarks import (
    OFFICIAL_COUNTS,
    load_aircraft,
    load_benchmark,
    load_cars196,
    load_cub,
    load_dogs,
    load_flowers102,
    load_inshop,
    load_nabirds,
    load_sop,
)
from .folder import load_csv, load_folder
from .registry import (build_dataset, canonical_dataset_name, dataset_option_hints, dataset_options, is_event_dataset,
                       list_datasets, register_dataset)
from .fashion_mnist import ArrayImageDataset, build_fashion_mnist
from .glyphs import GlyphDataset, build_glyph_dataset, gb2312_level1_chars
from .emoji import EmojiDataset, build_emoji_dataset
from .samplers import ClassBalancedBatchSampler, RandomBatchSampler
from .transforms import build_transform, list_transforms, register_transform, transform_option_hints, transform_options
from . import emoji_transform, timm_transform  # noqa: F401  (register the "emoji" and "timm" transforms)
from .loader import make_loader
from .events import (Event, EventDataset, EventList, VideoDecodeError, load_event_csv, load_hdd_events,
                     predict_events, read_frames)
from .synthetic_events import build_synthetic_events
from .synthetic import GaussianClusters, build_synthetic_dataset
