"""deepmetric.workflows: the commands that combine training, evaluation and reporting.

* :mod:`~deepmetric.workflows.demo`: ``deepmetric demo``, the offline demo (train on the
  embedded emoji or glyph benchmark, baselines, tables and pictures);
* :mod:`~deepmetric.workflows.study`: ``deepmetric study``, many runs (benchmarks x variants x
  seeds) with their statistics.

This layer sits on top of :mod:`deepmetric.train`, :mod:`deepmetric.report` and
:mod:`deepmetric.search` (docs/architecture.md); nothing below imports it.
"""
