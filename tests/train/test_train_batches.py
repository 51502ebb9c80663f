"""Training batches seeded by each sample's position: the augmentation of batch b does not
depend on the number of loader workers nor on the batch an epoch (re)started from."""
import random

import numpy as np
import torch

from deepmetric.data import RandomBatchSampler
from deepmetric.data.synthetic import build_synthetic_dataset
from deepmetric.train.batches import make_train_loader, sample_seed
from deepmetric.run.config_io import config_from_dict
from deepmetric.train.loop import train
from conftest import synthetic_config


def _batches(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


def test_resumed_epoch_with_a_worker_sees_the_same_augmented_batches():
    ds = build_synthetic_dataset("train", num_classes=4, per_class=12, dim=8, augment=0.5)
    sampler = RandomBatchSampler(len(ds), 8, seed=1)
    sampler.set_epoch(3)
    loader = make_train_loader(ds, sampler, epoch=3, start=0, run_seed=7, num_workers=1)
    assert loader.num_workers == 1  # a worker process really loads (else the comparison below is trivial)
    full = _batches(loader)
    assert len(full) == 6
    # the run resumes after 2 batches: the sampler skips them, the loader starts at batch 2
    sampler.load_state_dict(sampler.state_dict(batches_done=2))
    rest = _batches(make_train_loader(ds, sampler, epoch=3, start=2, run_seed=7, num_workers=1))
    assert len(rest) == 4
    for (xa, ya), (xb, yb) in zip(full[2:], rest):
        assert torch.equal(ya, yb) and torch.equal(xa, xb)
    # the augmentation is real (differs from the clean samples) and changes with the epoch
    clean = torch.stack([ds.x[i] for i in sampler.batches_for_epoch(3)[2]])
    assert not torch.allclose(rest[0][0], clean)
    sampler.set_epoch(3)
    zero_workers = _batches(make_train_loader(ds, sampler, epoch=3, start=0, run_seed=7, num_workers=0))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(full, zero_workers))
    other_epoch = _batches(make_train_loader(ds, sampler, epoch=4, start=0, run_seed=7, num_workers=0))
    assert not torch.equal(other_epoch[0][0], full[0][0])


def test_main_process_random_state_is_untouched_by_loading():
    ds = build_synthetic_dataset("train", num_classes=2, per_class=8, dim=4, augment=1.0)
    sampler = RandomBatchSampler(len(ds), 4, seed=0)
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    expected = (torch.rand(2).tolist(), np.random.rand(2).tolist(), random.random())
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    _batches(make_train_loader(ds, sampler, epoch=0, start=0, run_seed=0, num_workers=0))
    assert (torch.rand(2).tolist(), np.random.rand(2).tolist(), random.random()) == expected


def test_sample_seed_depends_on_every_part_of_the_position():
    base = sample_seed(0, 0, 0, 0, 0)
    assert base == sample_seed(0, 0, 0, 0, 0)
    assert len({base, sample_seed(1, 0, 0, 0, 0), sample_seed(0, 1, 0, 0, 0), sample_seed(0, 0, 1, 0, 0),
                sample_seed(0, 0, 0, 1, 0), sample_seed(0, 0, 0, 0, 1)}) == 6


def test_training_is_identical_with_zero_and_two_workers(tmp_path, monkeypatch):
    import deepmetric.train.batches as batches

    used = []

    class Recording(torch.utils.data.DataLoader):  # the training loader's worker count, as built
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            used.append(self.num_workers)

    monkeypatch.setattr(batches, "DataLoader", Recording)

    def run(workers):
        raw = synthetic_config(tmp_path / f"w{workers}", per_class=12,
                               data={"num_workers": workers, "options": {"augment": 0.3}},
                               train={"epochs": 2, "batch_size": 12, "seed": 3}, eval={"every": 0})
        train(config_from_dict(raw))
        return torch.load(tmp_path / f"w{workers}" / "last.pt", weights_only=True)["model"]

    a, b = run(0), run(2)
    assert used and set(used) == {0, 2}  # the second run's batches did come from two workers
    assert all(torch.equal(a[k], b[k]) for k in a)


class _Glyphs(torch.utils.data.Dataset):
    """Six 16x16 uint8 "glyphs" (a bar each) behind the batched glyph transform."""

    def __init__(self, transform):
        self.transform = transform
        self.images = torch.zeros(6, 1, 16, 16, dtype=torch.uint8)
        for i in range(6):
            self.images[i, 0, 2 + i, 3:13] = 255
        self.labels = [0, 0, 1, 1, 2, 2]

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return self.transform(self.images[i]), self.labels[i]


def test_batched_augmentation_runs_in_the_collate_seeded_by_the_batch_position():
    from deepmetric.data import build_transform

    ds = _Glyphs(build_transform("glyph", train=True, batched=True, normalize="none"))
    assert ds[0][0].dtype == torch.uint8  # the per-image part does not even convert
    sampler = RandomBatchSampler(len(ds), 3, seed=0)
    sampler.set_epoch(1)
    torch.manual_seed(5)
    expected = torch.rand(2).tolist()
    torch.manual_seed(5)
    full = _batches(make_train_loader(ds, sampler, epoch=1, start=0, run_seed=7, num_workers=0))
    assert torch.rand(2).tolist() == expected  # the main process's stream is untouched
    assert len(full) == 2 and all(x.dtype == torch.float32 and x.shape == (3, 1, 16, 16) for x, _ in full)
    # augmented (the bars moved / blurred / got noise), not just converted
    clean = torch.stack([ds.images[i].float() / 255 for i in sampler.batches_for_epoch(1)[0]])
    assert not torch.allclose(full[0][0], clean, atol=1e-3)
    # a worker, or a resume at batch 1, gives the same batches
    loader = make_train_loader(ds, sampler, epoch=1, start=0, run_seed=7, num_workers=1)
    assert loader.num_workers == 1
    with_worker = _batches(loader)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(full, with_worker))
    sampler.load_state_dict(sampler.state_dict(batches_done=1))
    rest = _batches(make_train_loader(ds, sampler, epoch=1, start=1, run_seed=7, num_workers=0))
    assert len(rest) == 1 and torch.equal(rest[0][0], full[1][0]) and torch.equal(rest[0][1], full[1][1])
    sampler.set_epoch(2)
    other = _batches(make_train_loader(ds, sampler, epoch=2, start=0, run_seed=7, num_workers=0))
    assert not torch.equal(other[0][0], full[0][0])
