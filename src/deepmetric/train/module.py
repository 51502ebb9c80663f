"""The module that is trained: model + weighted loss terms (``TrainingModule``), and the
class-means initialisation of classifier losses."""
from __future__ import annotations

import torch
from torch import nn

from . import distributed as D
from deepmetric.run.device import autocast_context

__all__ = ["TrainingModule", "PretrainedTeacher", "init_from_class_means", "is_pair_based"]

def is_pair_based(loss: nn.Module) -> bool:
    """Whether a loss's value depends on pairs / tuples of batch samples (the loss class says
    so with ``pair_based = True``: triplet, N-pair, ALMN, contrastive, lifted): under DDP such a
    term sees the embeddings of all ranks.  Per-sample losses (heated softmax, Proxy-NCA, CE)
    stay local (DDP's gradient average is then the global-batch mean), and the centre loss
    all-reduces its own centre update."""
    return bool(getattr(loss, "pair_based", False))


class TrainingModule(nn.Module):
    """Model + loss terms as one module, so DDP synchronises both (classifier-loss parameters
    such as heated-softmax ``W`` are trained like model parameters).

    ``forward(x, y)`` returns ``(total, parts)``: ``total = sum_i weight_i * term_i``.  When
    distributed, terms flagged ``gather`` see the embeddings/labels of all ranks and are
    multiplied by ``world_size`` so that DDP's gradient averaging gives exactly the
    single-process gradient of the whole global batch (see ``deepmetric.train.distributed``).

    A loss that lists model outputs in ``extra_inputs`` (``similarity_distillation``:
    ``("pretrained_features",)``) gets them by keyword; ``pretrained_features`` come from
    ``teacher``, a frozen copy of the pretrained model (:class:`PretrainedTeacher`), which is a
    submodule here (it follows ``.to(device)``) but neither of the model nor of the losses, so
    no checkpoint holds it.
    """

    def __init__(self, model: nn.Module, losses: nn.ModuleList, terms, *, world_size: int = 1,
                 amp: str = "none", device: torch.device | None = None, teacher: nn.Module | None = None):
        super().__init__()
        self.model = model
        self.losses = losses
        self.teacher = teacher
        self.weights = [float(t.weight) for t in terms]
        self.inputs = [t.input for t in terms]
        self.names = [t.name for t in terms]
        self.gather = [t.gather if t.gather is not None else is_pair_based(loss) for t, loss in zip(terms, losses)]
        self.world_size = world_size
        self.amp = amp
        self.device = device or torch.device("cpu")

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        with autocast_context(self.device, self.amp):
            out = self.model(x)
            if self.teacher is not None:
                out["pretrained_features"] = self.teacher(x)
        total = 0.0
        parts = []
        # Losses in float32 outside autocast: softmax temperatures and distances need it.
        with torch.autocast(device_type=self.device.type, enabled=False):
            for name, loss, w, inp, gather in zip(self.names, self.losses, self.weights,
                                                   self.inputs, self.gather):
                if inp not in out:
                    raise ValueError(f"loss term {name!r} reads the model output {inp!r}, but the model "
                                     f"returns only {sorted(out)}")
                z = out[inp].float()
                extra = {}
                for key in getattr(loss, "extra_inputs", ()):
                    if key not in out:
                        raise ValueError(f"loss term {name!r} needs the model output {key!r}, which this run "
                                         f"does not compute (the trainer builds a pretrained teacher only "
                                         f"for losses that list it in extra_inputs)")
                    extra[key] = out[key].float()
                if gather and self.world_size > 1:
                    extra = {k: D.all_gather_with_grad(v) for k, v in extra.items()}
                    value = loss(D.all_gather_with_grad(z), D.all_gather_with_grad(y), **extra) * self.world_size
                else:
                    value = loss(z, y, **extra)
                parts.append(value)
                total = total + w * value
        return total, parts


class PretrainedTeacher(nn.Module):
    """A frozen copy of a model as it is now (before the first step: the pretrained network),
    giving its pooled backbone features ``forward_head(forward_features(x), pre_logits=True)``
    in float32, without gradient.

    Its parameters have ``requires_grad=False`` (no optimiser sees them: the trainer builds the
    optimiser from the model and the losses) and it stays in eval mode whatever ``train()``
    asks (running statistics fixed, no dropout): it never changes during training.  It is not
    saved: a resumed run rebuilds it from the checkpoint's ``start_model`` (the model as the run
    started)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        import copy

        self.net = copy.deepcopy(model)
        for p in self.net.parameters():
            p.requires_grad_(False)
        self.net.eval()

    def train(self, mode: bool = True):
        return super().train(False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.forward_head(self.net.forward_features(x), pre_logits=True).float()


@torch.no_grad()
def init_from_class_means(model: nn.Module, loss: nn.Module, dataset, *, device: torch.device,
                          batch_size: int = 256, seed: int = 0, amp: str = "none",
                          output: str = "embedding") -> None:
    """Heated-up paper, official code for SOP: set the classifier's weights to the
    l2-normalised per-class means of the training embeddings before training.

    ``output`` is the model output the loss reads (``embedding`` or ``projection``).
    The embeddings are taken as the loss will see them in the first steps: batch-norm layers
    use the statistics of (shuffled, seeded) batches rather than their untrained running
    averages, dropout is off, and every buffer (running statistics) is restored afterwards.
    """
    if not hasattr(loss, "init_from_class_means"):
        raise ValueError(f"config key 'loss.init': {type(loss).__name__} has no class weights to "
                         f"initialise from class means (use it with heated_softmax)")
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    was_training = model.training
    model.train()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.eval()
    g = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=g,
                                         drop_last=len(dataset) > batch_size)
    embs, labels = [], []
    try:
        for x, y in loader:
            with autocast_context(device, amp):
                embs.append(model(x.to(device))[output].float())
            labels.append(torch.as_tensor(y).to(device))
    finally:
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(buffers[k])
        model.train(was_training)
    loss.init_from_class_means(torch.cat(embs), torch.cat(labels))


@torch.no_grad()
def init_head_from_pca(model: nn.Module, dataset, *, device: torch.device, batch_size: int = 256,
                       amp: str = "none", channels_last: bool = False, num_workers: int = 0) -> dict:
    """``model.options.head_init: pca | pca_whiten``: before the first step, set the embedding
    head's projection from the PCA of the pooled backbone features of ``dataset`` (the training
    split with the test transform), taken in eval mode as retrieval takes them
    (:meth:`deepmetric.models.EmbeddingHead.init_from_pca`).  Returns a summary for the logs:
    ``{"images", "explained_variance"}`` (the share of the features' variance the k
    directions keep)."""
    from deepmetric.models import EmbeddingHead
    from deepmetric.run.embed import compute_embeddings

    head = model.head
    if not isinstance(head, EmbeddingHead):
        raise ValueError(f"config key 'model.options.head_init': {type(model).__name__} has no embedding head "
                         f"with a linear projection to initialise from a PCA")
    feats = compute_embeddings(model, dataset, batch_size=batch_size, device=device, amp=amp,
                               channels_last=channels_last, num_workers=num_workers, output="features")
    features = torch.from_numpy(feats["embeddings"])
    try:
        stats = head.init_from_pca(features, whiten=model.head_init == "pca_whiten")
    except ValueError as exc:
        raise ValueError(f"config key 'model.options.head_init': {exc}") from None
    total = features.double().var(0).sum()
    return {"images": int(features.shape[0]),
            "explained_variance": float(stats["variances"].sum() / total) if total > 0 else 0.0}
