"""The loop's wait: a wake-up flag a select can wait on, and the LISTEN connection beside it."""

from __future__ import annotations

import os
import threading

from outbox.delivery import wakeup
from tests.support.patience import PATIENCE_S


def test_a_wake_up_before_the_wait_is_not_lost() -> None:
    waker = wakeup.Waker()
    waker.set()  # before the pipe exists
    try:
        assert waker.wait(PATIENCE_S)  # True: the wake-up ended it, not the time limit
    finally:
        waker.close()


def test_clear_forgets_and_a_wait_then_times_out() -> None:
    waker = wakeup.Waker()
    waker.open()
    try:
        waker.set()
        waker.set()
        waker.clear()
        assert not waker.is_set()
        assert not waker.wait(0.05)
    finally:
        waker.close()


def test_a_set_from_another_thread_ends_the_wait() -> None:
    waker = wakeup.Waker()
    waker.open()
    timer = threading.Timer(0.05, waker.set)
    try:
        timer.start()
        assert waker.wait(PATIENCE_S)  # True: the set ended it, not the time limit
    finally:
        timer.cancel()
        waker.close()


def test_a_readable_descriptor_ends_the_wait() -> None:
    waker = wakeup.Waker()
    read, write = os.pipe()
    try:
        os.write(write, b"n")
        assert waker.wait(10.0, also=read)
        assert not waker.is_set()
    finally:
        for fd in (read, write):
            os.close(fd)
        waker.close()


def test_a_set_after_close_touches_no_descriptor() -> None:
    waker = wakeup.Waker()
    waker.open()
    waker.close()
    # The numbers are free again: another file may hold them now.
    read, write = os.pipe()
    try:
        waker.set()
        os.set_blocking(read, False)
        try:
            leaked = os.read(read, 1)
        except BlockingIOError:
            leaked = b""
        assert leaked == b""
        assert waker.is_set()
    finally:
        for fd in (read, write):
            os.close(fd)
