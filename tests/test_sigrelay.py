"""ftrun.sigrelay: signal handlers take no lock; the action runs on the relay's thread."""

from __future__ import annotations

import os
import signal
import threading
import time

from conftest import wait_for

from ftrun.sigrelay import SignalRelay


def test_a_signal_needing_a_lock_the_main_thread_holds_is_acted_on_once_it_is_released() -> None:
    # What deadlocked a store: SIGUSR1 twice while its main thread was inside Event.set.
    lock = threading.Lock()
    acted: list[tuple[int, bool, str]] = []

    def act(signum: int) -> None:
        got = lock.acquire(timeout=10)
        acted.append((signum, got, threading.current_thread().name))
        if got:
            lock.release()

    relay = SignalRelay(act, signal.SIGUSR1, signal.SIGUSR2).start()
    try:
        with lock:
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.3)  # the handlers have run; the actions wait for the lock
            assert not acted
        wait_for(lambda: len(acted) == 2, 10, "both signals acted on")
    finally:
        relay.close()
    assert acted == [(signal.SIGUSR1, True, "ftrun-signals"), (signal.SIGUSR2, True, "ftrun-signals")]


def test_a_burst_of_signals_is_acted_on_in_order_and_close_puts_the_old_handlers_back() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    acted: list[int] = []
    relay = SignalRelay(acted.append, signal.SIGUSR1, signal.SIGUSR2).start()
    try:
        sent = [signal.SIGUSR1 if i % 3 else signal.SIGUSR2 for i in range(300)]
        for sig in sent:
            os.kill(os.getpid(), sig)  # the handler runs before the next statement
        wait_for(lambda: len(acted) == len(sent), 10, "every signal acted on")
        assert acted == sent
    finally:
        relay.close()
    assert signal.getsignal(signal.SIGUSR1) == before
    assert not [t for t in threading.enumerate() if t.name == "ftrun-signals"]


def test_an_action_that_fails_does_not_stop_the_relay() -> None:
    acted: list[int] = []

    def act(signum: int) -> None:
        acted.append(signum)
        if len(acted) == 1:
            raise RuntimeError("the first one fails")

    relay = SignalRelay(act, signal.SIGUSR1).start()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_for(lambda: len(acted) == 1, 10, "the first signal")
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_for(lambda: len(acted) == 2, 10, "the second signal")
    finally:
        relay.close()


def test_closing_twice_writes_nothing_to_the_descriptors_the_pipe_had() -> None:
    relay = SignalRelay(lambda _signum: None, signal.SIGUSR1).start()
    relay.close()
    read_fd, write_fd = os.pipe()  # likely the numbers the relay's closed pipe had
    try:
        os.set_blocking(read_fd, False)
        relay.close()
        try:
            leaked = os.read(read_fd, 16)
        except BlockingIOError:
            leaked = b""
        assert leaked == b"", "a second close wrote into a pipe the relay does not own"
    finally:
        os.close(read_fd)
        os.close(write_fd)
