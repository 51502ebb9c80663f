"""deepmetric.losses: metric-learning losses, each an ``nn.Module`` called ``loss(embeddings, labels)``.

``build_loss(name, **kwargs)`` builds one by name; ``list_losses()`` lists the names.
See docs/losses.md for the table of losses, papers and options.
"""
from __future__ import annotations

# every loss module registers its class with @register_loss where it is defined
from . import pml  # noqa: F401  (pytorch-metric-learning is imported only when the loss is built)
from .almn import ALMNLoss
from .center import CenterLoss
from .contrastive import ContrastiveLoss
from .cross_entropy import CrossEntropyLoss
from .heated_softmax import HeatedSoftmaxLoss
from .lifted import LiftedStructureLoss
from .npair import NPairLoss, select_npairs
from .proxy_nca import ProxyNCALoss
from .registry import build_loss, list_losses, loss_class, loss_options, register_loss
from .similarity_distillation import SimilarityDistillationLoss
from .triplet import TripletLoss, mine_all, mine_batch_hard, mine_semihard

__all__ = [
    "ALMNLoss",
    "CenterLoss",
    "ContrastiveLoss",
    "CrossEntropyLoss",
    "HeatedSoftmaxLoss",
    "LiftedStructureLoss",
    "NPairLoss",
    "ProxyNCALoss",
    "SimilarityDistillationLoss",
    "TripletLoss",
    "build_loss",
    "list_losses",
    "loss_class",
    "loss_options",
    "mine_all",
    "mine_batch_hard",
    "mine_semihard",
    "register_loss",
    "select_npairs",
]

