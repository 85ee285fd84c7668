"""One prompt under different slicings, row by row: its one home is the package's
``vllm_bi100_patch.ops.selftest.slicing`` (the operator's ``selftest`` runs it); the test modules
keep importing it from here."""

from vllm_bi100_patch.ops.selftest.slicing import *  # noqa: F401,F403
