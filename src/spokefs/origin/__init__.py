"""Origins other than a local folder: where a hub reads a dataset's bytes from."""
