"""``ixformer.contrib`` of the fake ixformer: only ``contrib.xformers`` (see there)."""
