"""The tiny synthetic-events training config shared by the event tests (a two-head model on
5-channel 16 x 16 event frames: trains in about a second)."""


def synthetic_events_config(out_dir, **eval_extra) -> dict:
    """Config dict: 40 train / 20 test synthetic events, two-head glyph ResNet, CE + semi-hard
    triplet, 3 iterations, final evaluation on the validation split (``eval_extra`` adds or
    replaces eval keys)."""
    return {
        "data": {"name": "synthetic_events", "options": {"num_train": 40, "num_test": 20, "size": 16, "cache": True},
                 "transform": "sod"},
        "model": {"name": "two_head", "options": {"backbone": "glyph_resnet", "in_chans": 5, "input_size": 16,
                                                  "embedding_dim": 16, "widths": [8, 16], "depths": [1, 1]}},
        "loss": [{"name": "cross_entropy", "input": "logits"},
                 {"name": "triplet", "input": "embedding", "options": {"mining": "semihard", "margin": 0.2}}],
        "train": {"iterations": 3, "batch_size": 11, "seed": 0, "out_dir": str(out_dir), "progress": False,
                  "device": "cpu"},
        "eval": {"every": 0, "split": "val", "ks": [1], "metrics": ["recall"], "classification": True,
                 **eval_extra},
    }
