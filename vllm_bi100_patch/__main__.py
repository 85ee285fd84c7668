"""``python -m vllm_bi100_patch`` (also the ``vllm-bi100-patch`` console script).

  status          the verdict (without the code check) and this process's state; patches
                  nothing, imports no vLLM; exits 0
  doctor          the verdict with every check: configuration, vLLM version, hardware,
                  activation paths, the code check of each patch (imports vLLM's paged_attn
                  behind the import guard, so the shim patches it in this process as it would in
                  a server); exit code below
  selftest        the shim measured on this machine's device: correctness checks, decode and
                  prefix timings at the model's shape, the projection and the settings that
                  follow (needs torch; `selftest --help`; docs/selftest.md); exit 0 passed,
                  1 a check failed, 4 refused (not enough free memory), 5 a wedged card (the
                  device did not answer in time)
  env-table       the README's table of environment variables
  versions-table  the README's table of supported vLLM versions

doctor exit codes:
  0  the shim does what the configuration asks: it will patch this vLLM, or it stays off on
     purpose (VLLM_BI100_PATCH=0, or auto on a machine without the Iluvatar stack)
  1  the configuration asks for patching but the shim will not patch here (vLLM not
     installed, unsupported version, failed code check, no activation path)
  3  a VLLM_BI100_* variable holds an invalid value (the shim ignores it: fix it)
  5  a wedged card: the device did not answer its first contact (a child process) within
     VLLM_BI100_CONTACT_TIMEOUT_S; only a host restart recovers it (docs/operating.md)
  (2 is argparse's: a usage error)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .activation import config
from .patching import decision, versions
from .ops import doctor
from . import status
from ._version import __version__
from .patching.decision import EXIT_CONFIG as EXIT_CONFIG  # re-exported: the README documents them
from .patching.decision import EXIT_OK as EXIT_OK
from .patching.decision import EXIT_WONT_PATCH as EXIT_WONT_PATCH
from .ops.selftest.contact import EXIT_WEDGED as EXIT_WEDGED


def main(argv: Any = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["selftest"]:  # its own options (torch imported only past the guard)
        from .ops.selftest.guarded import main as selftest_main

        return selftest_main(args_list[1:])
    parser = argparse.ArgumentParser(prog="vllm-bi100-patch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"vllm-bi100-patch {__version__}")
    parser.add_argument("command", choices=["status", "doctor", "selftest", "env-table", "versions-table"])
    parser.add_argument("--json", action="store_true", help="status as JSON")
    args = parser.parse_args(argv)
    if args.command == "status":
        data = status()
        settings = config.load()
        result = decision.verdict(settings, versions.installed_vllm_version())
        data["verdict"] = result.line()
        if args.json:
            print(json.dumps(data, indent=2, default=str))
        else:
            print("\n".join(doctor.process_lines(data)))
            print(result.line())
        return 0
    if args.command == "doctor":
        return doctor.run()
    if args.command == "env-table":
        print(config.env_table())
        return 0
    print(versions.support_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
