"""Each stage's typed config (the dataclass OmegaConf checks a YAML file against), built from the
infrastructure's sections in ``trainer/config.py`` and the data sections in ``data/``."""
