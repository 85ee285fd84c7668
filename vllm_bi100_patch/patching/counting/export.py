"""The shim's series on vLLM's ``/metrics``: one exporter per process that patched.

``start()`` is called where a process patched (``bootstrap``); it starts nothing when
``VLLM_BI100_METRICS_INTERVAL_S=0`` or under the kill switch (the bootstrap never gets there).
A daemon thread then wakes every interval (a scrape-independent period) and:

- where ``PROMETHEUS_MULTIPROC_DIR`` names a directory (vLLM's multiprocessing front end sets
  it before it starts the engine; workers inherit it): writes this process's counts to
  prometheus_client's multiprocess files there, the way its metrics do (``MultiProcessValue``:
  created after the directory is known, counters, one histogram, one ``max`` gauge; no gauge
  that needs live-process aggregation).  The files are the shim's own
  (``counter_vllm-bi100-<pid>.db``), never the ones vLLM's metrics of the same process map.
  vLLM's ``/metrics`` sums every process's files.  Staleness: at most one interval;
  a final flush at normal exit (atexit, and multiprocessing's finalizers in forked children).
  A directory that was removed, recreated or emptied (or a variable that now names another
  one) is noticed at the next flush: the files are opened anew there and every series is
  written again (a WARNING says so); a flush that fails leaves ``status()["metrics"]`` in mode
  ``failed`` with the error, until one succeeds;
- where it is not set and prometheus_client is already imported (a registry is in use),
  registers a collector on prometheus_client's default registry once this process has counted
  a patched call: it reads the counts when scraped (no staleness, no cost between scrapes);
- otherwise does nothing: nothing is written, nothing is imported.

The hot path never sees any of this: counting stays plain integers (``metrics.TALLY`` and the
patch layer's counters).  A forked child exports what it counts after the fork (the counts it
inherited are its parent's, exported by the parent).  The exporter never sets
``PROMETHEUS_MULTIPROC_DIR`` and never touches vLLM's own metrics.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any, Dict, List, Optional, Set, Tuple

from . import metrics
from ...activation.log import log

DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def _identifier() -> str:
    """The ``pid`` part of the shim's multiprocess file names (never a file vLLM's own
    metrics of this process map: two writers of one mmap file would overwrite each other)."""
    return f"vllm-bi100-{os.getpid()}"


class Exporter:
    """This process's exporter (see the module docstring)."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.info: Optional[Dict[str, str]] = None
        self.mode = "idle"
        self.directory: Optional[str] = None
        self.flushes = 0
        self.last_error: Optional[str] = None
        self._lock = threading.Lock()  # around one flush; taken before a fork
        self._base: Dict[metrics.Key, int] = {}
        self._value_cls: Any = None
        self._values: Dict[Tuple[str, metrics.Labels], Any] = {}
        self._written: Dict[Tuple[str, metrics.Labels], float] = {}
        self._files: Set[str] = set()  # the multiprocess files this process has opened
        self.reopened = 0
        self._collector: Any = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # --- the thread --------------------------------------------------------------------------

    def start_thread(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-bi100-metrics",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5)
        self._thread = None
        self.unregister()

    def _run(self) -> None:
        while True:
            self.tick()
            if self._stop.wait(self.interval):
                return

    def counts(self) -> Dict[metrics.Key, int]:
        """This process's counts since the fork that made it (if any)."""
        return metrics.since(metrics.snapshot(), self._base)

    def tick(self, final: bool = False) -> None:
        """One flush: files, the in-process collector, or nothing (never raises)."""
        try:
            with self._lock:
                path = os.environ.get(DIR_ENV)
                if path:
                    if not os.path.isdir(path):
                        self.directory = path
                        self.mode = "no directory"  # never created here: vLLM's choice
                        return
                    self._reopen_if_gone(path)
                    self.directory = path
                    self.unregister()
                    self._write(path)
                    self.mode, self.last_error = "files", None
                elif "prometheus_client" in sys.modules and self._collector is None \
                        and not final and any(self.counts().values()):
                    self._register()
                    self.mode = "registry"
        except Exception as exc:  # the host process goes on; say it once per failing spell
            if self.mode != "failed":
                log.warning("vllm-bi100-patch: exporting metrics failed (%s: %s); the shim's "
                            "series may be missing from /metrics", type(exc).__name__, exc)
            self.mode = "failed"
            self.last_error = f"{type(exc).__name__}: {exc}"

    # --- multiprocess files --------------------------------------------------------------------

    def _reopen_if_gone(self, path: str) -> None:
        """Forget the open files when the directory is another one or one of them is gone
        (removed, or the directory recreated: an inode number can come back, a file cannot):
        prometheus_client keeps writing into the maps of deleted files, and the written-cache
        would never rewrite a value that did not change."""
        if not self._files:
            return
        if path == self.directory and all(os.path.exists(f) for f in self._files):
            return
        log.warning("vllm-bi100-patch: %s %s lost this process's metrics files (%s); "
                    "writing every series again there", DIR_ENV, path,
                    "it names another directory now" if path != self.directory else
                    "the directory was removed, recreated or emptied")
        self._forget_files()
        self.reopened += 1

    def _forget_files(self) -> None:
        for obj in self._values.values():
            mapped = getattr(obj, "_file", None)  # prometheus_client's MmapedDict of the file
            try:
                if mapped is not None:
                    mapped.close()
            except Exception:  # already closed (one map serves several values)
                pass
        self._value_cls = None
        self._values.clear()
        self._written.clear()
        self._files.clear()

    def _write(self, path: str) -> None:
        if self._value_cls is None:
            from prometheus_client import values

            self._value_cls = values.MultiProcessValue(process_identifier=_identifier)
        seen = set()
        for name, kind, text, samples in metrics.families(self.counts(), self.info):
            for sname, labels, value in samples:
                key = (sname, labels)
                seen.add(key)
                if self._written.get(key) == value:
                    continue
                obj = self._values.get(key)
                if obj is None:
                    obj = self._values[key] = self._value_cls(
                        kind, name, sname, tuple(k for k, _ in labels),
                        tuple(v for _, v in labels), text,
                        multiprocess_mode="max" if kind == "gauge" else "")
                    # prometheus_client's file name for this kind (values.MmapedValue)
                    prefix = "gauge_max" if kind == "gauge" else kind
                    self._files.add(os.path.join(path, f"{prefix}_{_identifier()}.db"))
                obj.set(value)
                self._written[key] = value
        for key in list(self._written):
            if key not in seen and self._written[key] != 0.0:  # e.g. the info of old rows
                self._values[key].set(0.0)
                self._written[key] = 0.0
        self.flushes += 1

    # --- the in-process registry ---------------------------------------------------------------

    def _register(self) -> None:
        import prometheus_client

        collector = _Collector(self)
        prometheus_client.REGISTRY.register(collector)
        self._collector = collector

    def unregister(self) -> None:
        collector, self._collector = self._collector, None
        if collector is not None and "prometheus_client" in sys.modules:
            try:
                sys.modules["prometheus_client"].REGISTRY.unregister(collector)
            except KeyError:
                pass

    # --- fork --------------------------------------------------------------------------------

    def after_fork_in_child(self) -> None:
        """Count from zero (the parent exports what it counted), in new files, with a new
        thread (threads do not survive a fork)."""
        self._lock = threading.Lock()
        metrics.TALLY.after_fork()
        self._base = metrics.snapshot()
        self._value_cls = None
        self._values.clear()
        self._written.clear()
        self._files.clear()
        self.flushes = 0
        if self._thread is not None:
            self.start_thread()

    def final(self) -> None:
        if self.mode == "files" or os.environ.get(DIR_ENV):
            self.tick(final=True)


class _Collector:
    """Serves this process's counts from prometheus_client's default registry, read when
    scraped (single-process servers: no ``PROMETHEUS_MULTIPROC_DIR``)."""

    def __init__(self, exporter: Exporter) -> None:
        self._exporter = exporter

    def describe(self) -> List[Any]:
        return []  # no collect() at registration

    def collect(self) -> Any:
        from prometheus_client.metrics_core import Metric

        e = self._exporter
        for name, kind, text, samples in metrics.families(e.counts(), e.info):
            metric = Metric(name, text, kind)
            cumulative: Dict[metrics.Labels, float] = {}
            for sname, labels, value in samples:
                if sname.endswith("_bucket"):
                    base = tuple(kv for kv in labels if kv[0] != "le")
                    cumulative[base] = cumulative.get(base, 0.0) + value
                    value = cumulative[base]
                metric.add_sample(sname, dict(labels), value)
            for base, total in cumulative.items():
                metric.add_sample(name + "_count", dict(base), total)
            yield metric


_exporter: Optional[Exporter] = None
_start_lock = threading.Lock()
#: Set by ``doctor`` (it patches in its own process, which must not export).
suppressed = False


def start(interval: int, report: Any) -> None:
    """Export from this process (idempotent; a later call updates the info series with the
    rows applied so far).  ``report``: the registry's merged report.  Nothing starts while no
    row is applied here: a process that only met a target module which needs no row (vLLM
    0.6.3's front end imports ``vllm.sequence``, where the official wheel needs no
    ``stream_delta``) counts nothing and would only add an info series of no rows."""
    global _exporter
    if interval <= 0 or suppressed or not report.applied:
        return
    from ..._version import __version__

    info = {"shim_version": __version__, "vllm_version": str(report.vllm_version or ""),
            "family": str(report.family or ""), "rows": ",".join(sorted(report.applied))}
    with _start_lock:
        if _exporter is not None:
            _exporter.info = info
            return
        exporter = Exporter(interval)
        exporter.info = info
        _exporter = exporter
        _register_process_hooks(exporter)
        exporter.start_thread()


_hooks_registered = False


def _register_process_hooks(exporter: Exporter) -> None:
    """atexit and fork hooks (once per interpreter: they act on the current exporter)."""
    global _hooks_registered
    if not _hooks_registered:
        _hooks_registered = True
        atexit.register(_final)
        os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent,
                            after_in_child=_after_fork_child)
    import multiprocessing.util as mp_util

    # multiprocessing's forked children leave through os._exit (no atexit): a finalizer,
    # registered in the child after multiprocessing cleared the parent's, flushes there.
    mp_util.register_after_fork(exporter, _arm_finalizer)


def _arm_finalizer(exporter: Exporter) -> None:
    import multiprocessing.util as mp_util

    mp_util.Finalize(None, exporter.final, exitpriority=0)


def _final() -> None:
    if _exporter is not None:
        _exporter.final()


def _before_fork() -> None:
    if _exporter is not None:
        _exporter._lock.acquire()  # no flush in progress while the process forks


def _after_fork_parent() -> None:
    if _exporter is not None:
        _exporter._lock.release()


def _after_fork_child() -> None:
    if _exporter is not None:
        _exporter.after_fork_in_child()


def stop() -> None:
    """Stop this process's exporter (tests): its thread, its collector; files stay."""
    global _exporter
    with _start_lock:
        exporter, _exporter = _exporter, None
    if exporter is not None:
        exporter.stop()


def exporter() -> Optional[Exporter]:
    return _exporter


def state() -> Dict[str, Any]:
    """For ``status()``: where this process exports its series."""
    e = _exporter
    if e is None:
        return {"export": "off" if suppressed else "not started"}
    return {"export": e.mode, "directory": e.directory, "interval_s": e.interval,
            "flushes": e.flushes, "reopened": e.reopened, "last_error": e.last_error}
