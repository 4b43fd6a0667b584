"""Subprocess jobs the suite starts as soon as collection ends, one at a time on a background thread, so that
the sm90 ahead-of-time compiles (minutes of CPU, no GPU) run on a second core while the rest of the suite
runs on the first. A test declares its jobs with ``@background.jobs(fn)`` (``fn()`` returns
``{key: (argv, popen_kwargs)}``, or {} where the test will skip) and reads a job's result with
``background.result(key, argv, **kw)``: the job's ``subprocess.CompletedProcess``, waited for, or run on the
spot when nothing started it (a test run alone)."""

from __future__ import annotations

import atexit
import subprocess
import threading

_JOBS: dict = {}  # key -> [argv, kwargs, threading.Event, CompletedProcess | BaseException | None]
_QUEUE: list = []
_LOCK = threading.Lock()
_RUNNING: set = set()  # the worker's live processes: killed at exit (a run stopped early leaves no compile behind)


@atexit.register
def _kill_running():
    for proc in list(_RUNNING):
        proc.kill()


def jobs(fn):
    """Decorator: ``fn`` lists the test's jobs (see the module docstring)."""

    def mark(test):
        test.background_jobs = fn
        return test

    return mark


def _run(argv, kw):
    """``subprocess.run(argv, capture_output=True, text=True, **kw)``, its exception returned, not raised."""
    kw = dict(kw)
    timeout = kw.pop("timeout", None)
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    except BaseException as e:  # (the test re-raises it)
        return e
    _RUNNING.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as e:
        proc.kill()
        proc.communicate()
        return e
    finally:
        _RUNNING.discard(proc)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _worker():
    while True:
        with _LOCK:
            if not _QUEUE:
                return
            key = _QUEUE.pop(0)
        job = _JOBS[key]
        job[3] = _run(job[0], job[1])
        job[2].set()


def start(items) -> None:
    """Queue the jobs of the collected ``items`` (in their order) and start the thread that runs them."""
    for item in items:
        fn = getattr(getattr(item, "function", None), "background_jobs", None)
        if fn is None:
            continue
        for key, (argv, kw) in fn().items():
            if key not in _JOBS:
                _JOBS[key] = [argv, kw, threading.Event(), None]
                _QUEUE.append(key)
    if _QUEUE:
        threading.Thread(target=_worker, name="background-jobs", daemon=True).start()


def result(key, argv, **kw) -> subprocess.CompletedProcess:
    """The finished job ``key`` (started by ``start``), or ``argv`` run now with ``kw`` when it was not."""
    with _LOCK:
        job = _JOBS.get(key)
        if job is not None and key in _QUEUE:  # queued, not started: run it here instead of waiting
            _QUEUE.remove(key)
            job = None
    if job is None:
        r = _run(argv, kw)
    else:
        job[2].wait()
        r = job[3]
    if isinstance(r, BaseException):
        raise r
    return r
