"""Plain-data catalogs: the models and GPUs autotune knows by name."""
