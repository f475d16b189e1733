"""Running set-up work on a thread that then exits, so that one thread owns OpenMP.

libgomp keeps a pool of worker threads per thread that starts parallel regions, and when
the pools together hold more threads than the machine has CPUs its idle workers stop
spinning after ~100 iterations and sleep: every parallel region then pays a futex wake-up.
A server that loads the model on the main thread (whose pool stays) and steps the engine
on its own thread ran each op 10x slower (a 16-row rms_norm 4 -> 50 us on 2 vCPUs) and
each decode step about 2x (3.6 -> 7.6 ms at batch 1). A thread's pool goes away when the
thread exits, so work that needs OpenMP before the engine thread starts runs here.
"""
from __future__ import annotations

import threading
from typing import Any, Callable


def run_on_fresh_thread(fn: Callable[..., Any], *args, name: str = "compress-setup", **kwargs) -> Any:
    """``fn(*args, **kwargs)`` on a new thread, joined; its result, or its exception raised here."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:   # noqa: BLE001 - re-raised on the calling thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("result")
