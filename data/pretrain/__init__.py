"""Pretraining data: reading text sources, ``lantern prepare`` into token shards with a manifest, and the
packed-window datamodule."""
