"""Lantern's shipped YAML presets: ``model/`` (model shapes), ``pretrain/``, ``sft/``, ``rm/``, ``ppo/`` (stage
configs) and ``pipeline/``. A package only so that they install with Lantern as package data and are found with
``importlib.resources`` (``models/config_checks.py``); it holds no code."""
