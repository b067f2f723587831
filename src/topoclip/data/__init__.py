"""Data: the built-in generated scenes, files a user brings (CSV, WebDataset shards, evaluation sets)."""
