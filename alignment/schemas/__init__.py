"""Each stage's typed config (the dataclass OmegaConf checks a YAML file against), built from the
infrastructure's sections and the data sections."""
