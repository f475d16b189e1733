"""Runs an op split by ``parallel_parts_stealing`` (kernel_common.h) with its first thread
held up, for the tests that check a take-over moves no bit."""
from __future__ import annotations

import torch


def run_with_a_held_thread(run, switch, hold_us: int = 3000):
    """``(plain, held, taken)`` on two threads: ``run()`` with ``switch(False)`` (the split
    before the take-over), then with ``switch(True)`` and thread 0 held ``hold_us`` at every
    split, and the items the other thread took over meanwhile. Restores the switch, the
    hold and the thread count."""
    from compress import _C

    threads = torch.get_num_threads()
    before = switch(False)
    try:
        torch.set_num_threads(2)
        plain = run()
        switch(True)
        _C.set_lanes_test_hold_us(hold_us)
        taken = _C.lanes_tiles_stolen()
        held = run()
        taken = _C.lanes_tiles_stolen() - taken
    finally:
        _C.set_lanes_test_hold_us(0)
        switch(before)
        torch.set_num_threads(threads)
    return plain, held, taken
