"""A run as an artifact (issue 31): what a finished run is and what every command that reads
one needs, between :mod:`deepmetric.train` (which trains) and :mod:`deepmetric.data`.

The rule that decides where a module lives: is it about *training* (the loop and its
``TrainState``, schedules, optimisers, DDP, trackers, mixed-precision scaling of the loss,
fine-tuning steps) -> ``train/``; or about *a run as an artifact*, something ``report``,
``search``, ``embed`` or a resumed run read back without training -> ``run/``.  ``report/`` and
``search/`` import ``run/``, never ``train/``.

* :mod:`.config` (the typed schema), :mod:`.config_types` (YAML values to the schema),
  :mod:`.config_checks` (values and option names, the one place a config is validated),
  :mod:`.config_io` (``load_config``, overrides, ``read_yaml_mapping``, ``save_config``);
* :mod:`.rundir`: the run directory, its file names and its log;
* :mod:`.checkpoint`: save / load (old versions upgraded) and the RNG state;
* :mod:`.builders`: a run's dataset splits, sampler, model and loss terms from its config;
* :mod:`.embed`: embedding with a model, loading a trained model back, ``deepmetric embed``;
  :mod:`.shards`: embedding over torchrun ranks;
* :mod:`.evaluation`: the evaluation policy (metric names, cross-domain, where searches run)
  and the evaluation itself; :mod:`.baselines`: epoch 0, raw pixels, pretrained features;
* :mod:`.device`: ``resolve_device`` and mixed precision (``autocast_context``).
"""
