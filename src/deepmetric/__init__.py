"""deepmetric: deep metric learning in PyTorch.

Subpackages: ``data`` (loaders, samplers, transforms), ``models`` (backbones, embedding
heads, two-head model), ``losses`` (one module per method), ``train`` (loop, schedules,
checkpoints, distributed), ``evaluate`` (retrieval, clustering, classification metrics),
``report`` (plots and run reports).
"""

__version__ = "0.1.0"
