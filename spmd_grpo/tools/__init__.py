"""Developer tools run as modules: `make_tiny_model` (a tiny random model of any supported family, for tests
and the smoke run), `synthetic_data` (writes the builtin geometry3k-schema rows to a parquet file) and
`config_docs` (prints docs/configuration.md from the config's fields, `make docs`)."""
