"""fa_jax.studies.sweep.cluster._wait_for: a process other than 0 waits for the
coordinator's port before asking JAX to connect (JAX's client retries a refused
connection only after about a second)."""

import socket
import threading
import time

from fa_jax.studies.sweep import cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_returns_as_soon_as_the_port_listens():
    port = _free_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_later():
        time.sleep(0.3)
        server.bind(("127.0.0.1", port))
        server.listen()

    thread = threading.Thread(target=listen_later)
    start = time.monotonic()
    thread.start()
    try:
        cluster._wait_for(f"127.0.0.1:{port}", limit_s=30)
        waited = time.monotonic() - start
    finally:
        thread.join()
        server.close()
    assert 0.3 <= waited < 5  # waited for the port, and not JAX's second-long retry


def test_gives_up_after_its_limit_on_a_port_nobody_opens():
    port = _free_port()
    start = time.monotonic()
    cluster._wait_for(f"127.0.0.1:{port}", limit_s=0.2)
    assert 0.2 <= time.monotonic() - start < 5
