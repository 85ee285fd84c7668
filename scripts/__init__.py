"""The repository's scripts (not part of the shipped package), a package so that
``from scripts import readme_tables`` finds these and not the top-level ``scripts`` package that
gguf (a vLLM dependency) installs into site-packages: the real-vLLM sessions collect the whole
tests/ tree and select their tests by marker."""
