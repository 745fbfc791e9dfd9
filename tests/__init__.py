"""Tests for Lantern; a package so that `pytest` puts the repository root on sys.path and `models`, `data` resolve to the project, not these folders."""
