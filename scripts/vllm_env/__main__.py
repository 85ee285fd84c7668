"""``python scripts/vllm_env ...`` (the directory) or ``python -m vllm_env ...``."""

import os
import sys

if not __package__:  # run as a directory: import the package from its parent
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_env import main  # noqa: E402

sys.exit(main())
