"""Client side of spokefs: ``spokefs.open`` and the ``spokefs://`` fsspec filesystem."""
