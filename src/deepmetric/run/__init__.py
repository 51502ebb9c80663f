"""A run as an artifact (issue 31): its config schema and validation, its directory, building its
parts from the config, checkpoints, loading a trained model back and embedding with it, its
evaluation policy and the baselines. Between train/ (which trains) and data/."""
