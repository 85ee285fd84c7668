"""``torch.cuda`` of a wedged card: it sees the device, its memory query never returns."""

import os
import signal
import threading


class _Properties:
    name = "Iluvatar BI-V100 (a wedged stand-in)"
    multi_processor_count = 16


def is_available():
    return True


def device_count():
    return 1


def get_device_properties(index=0):
    return _Properties()


def mem_get_info(index=None):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    path = os.environ.get("WEDGED_TORCH_PID_FILE")
    if path:
        with open(path, "w", encoding="ascii") as fh:
            fh.write(str(os.getpid()))
    threading.Event().wait()  # never returns
