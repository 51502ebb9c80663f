"""Degenerate batches every loss must survive with a finite value and finite gradients
(issue 4): all embeddings identical, zero vectors, one class only, one sample per class, and
batches of 2. Shared by the loss test modules so every loss faces the same cases."""
import torch

#: labels below go up to 5: build classifier-type losses with at least this many classes
NUM_CLASSES = 6


def degenerate_batches(dim: int = 4) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    def randn(n: int, seed: int) -> torch.Tensor:
        return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))

    pairs = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    return [
        ("identical", torch.full((8, dim), 0.3), pairs),
        ("zeros", torch.zeros(8, dim), pairs),
        ("one_class", randn(6, 1), torch.zeros(6, dtype=torch.long)),
        ("one_per_class", randn(6, 2), torch.arange(6)),
        ("two_same", randn(2, 3), torch.tensor([1, 1])),
        ("two_diff", randn(2, 4), torch.tensor([0, 5])),
    ]
