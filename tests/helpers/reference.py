"""The dense float64 reference and the paged-cache builders: their one home is the package's
``vllm_bi100_patch.ops.selftest.reference`` (the operator's ``selftest`` checks against it); the
test modules keep importing them from here."""

from vllm_bi100_patch.ops.selftest.reference import *  # noqa: F401,F403
from vllm_bi100_patch.ops.selftest.reference import FP8, TOLERANCE  # noqa: F401
