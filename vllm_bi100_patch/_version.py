"""The shim's version, in a module of its own so that any module can read it without
importing the package's face (setup.cfg reads it too)."""

__version__ = "0.1.0"
