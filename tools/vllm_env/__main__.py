"""``python tools/vllm_env ...`` (the directory) or ``python -m tools.vllm_env ...``."""

import os
import sys

if __package__:
    from . import main
else:  # run as a directory: import the package from its parent (tools/)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from vllm_env import main  # noqa: E402

sys.exit(main())
