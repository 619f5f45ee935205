"""puma.data: the eight UML datasets (and any class-per-folder catalogue) from release layouts to batches.

Modules, in the order data flows:

- ``schema``: the column, split and role names every stage imports; the Parquet schema.
- ``layouts`` / ``demo`` / ``sources``: converters from official release layouts (CUB, Cars-196,
  SOP, In-Shop, NABirds, Stanford Dogs, Flowers-102, FGVC-Aircraft), a class-per-folder layout and
  Fashion-MNIST IDX files to listings; the presets (``demo``, one per dataset, ``paper``).
- ``tables``: catalogue tables (CSV, JSONL, Parquet: item_id, image_uri, optional label, dataset,
  metadata columns) read into rows and rejects, for embedding and for the ``table`` preset.
- ``prepare``: listings -> Parquet shards + manifest + prepare rejects on any URI;
  ``ensure_prepared(cfg)`` builds the configured preset when it is missing.
- ``manifest`` / ``stats`` / ``rejects``: the manifest, counts and the Table 1 check, reject files.
- ``splits``: class ranges per split (validation carved from training classes) and the global
  training label map.
- ``images``: PIL decoding and the train / eval views (no Ray, no torch).
- ``pipeline``: the Ray Data streams for training and evaluation (the only module importing Ray).
- ``pseudo_labels``: k-means labels for methods that make their own (UDML-SS); FAISS and
  torch.distributed, imported only by those methods.

Importing ``puma.data`` imports none of them.
"""
