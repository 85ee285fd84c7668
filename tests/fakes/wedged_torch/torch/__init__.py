"""A torch whose one device never answers (tests only: ``tests/test_wedged_card.py``).

Put first on ``PYTHONPATH`` of a *child* process (the shim's first-contact probe imports it):
``torch.cuda`` sees one Iluvatar device, and ``torch.cuda.mem_get_info()`` blocks forever, as
on a wedged BI-V100; the process also ignores SIGTERM there (a driver call need not return to
Python to handle it), so only the probe's SIGKILL of its process group ends it.
"""

from . import cuda  # noqa: F401

__version__ = "0.0.0+wedged"
