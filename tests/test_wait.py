"""``redirect wait``, run the way a ``postStart`` hook runs it: a process inside the pod netns.

The proxy's readiness endpoint is a real HTTP listener inside a kit pod, capture is real
(installed by ``redirect.setup`` or not at all), and the command's exit code, output and
timing are what is checked.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redirect
from redirect import wait
from redirect.kernel import netns as rnetns
from tests.netkit import Pod


class Health:
    """An HTTP server on 127.0.0.1 inside ``ns``: 503 until ``ready_after`` s have passed, then 200
    (``ready_after=None``: never ready)."""

    def __init__(self, ns: str, ready_after: float | None, port: int = 0) -> None:
        self.t0 = time.monotonic()
        self.ready_after = ready_after
        self.answers: list[int] = []
        health = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                ready = health.ready_after is not None and time.monotonic() - health.t0 >= health.ready_after
                code = 200 if ready and self.path == "/healthz/ready" else 503
                health.answers.append(code)
                self.send_response(code)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        with rnetns.enter(ns):  # the listening socket belongs to the pod netns from here on
            self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/healthz/ready"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@contextmanager
def health(ns: str, ready_after: float | None, port: int = 0) -> Iterator[Health]:
    h = Health(ns, ready_after, port)
    try:
        yield h
    finally:
        h.close()


def wait_in(pod: Pod, *args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess[str], float]:
    """``redirect wait ARGS`` as a process in the pod netns (a container's exec hook); (result, seconds)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ISTIO_", "REDIRECT_FAULT"))}
    t0 = time.monotonic()
    p = subprocess.run(["ip", "netns", "exec", pod.name, sys.executable, "-m", "redirect.cli", "wait", *args],
                       capture_output=True, text=True, timeout=timeout, env=env)
    return p, time.monotonic() - t0


def test_returns_once_the_proxy_answers_200_in_a_captured_pod(pod: Pod) -> None:
    redirect.setup(pod.name)  # the init container's work: the hook's own HTTP to 127.0.0.1 is not captured
    try:
        with health(pod.name, ready_after=1.0) as h:
            p, took = wait_in(pod, "--url", h.url, "--netns", "/proc/self/ns/net", "--timeout", "20",
                              "--period-ms", "100")
        assert p.returncode == 0, p.stderr
        assert took >= 1.0 and "ready:" in p.stdout
        assert h.answers[-1] == 200 and 503 in h.answers  # it asked while not ready, and went on asking
    finally:
        redirect.teardown(pod.name)


def test_gives_up_after_the_timeout_naming_what_was_not_ready(pod: Pod) -> None:
    with health(pod.name, ready_after=None) as h:
        p, took = wait_in(pod, "--url", h.url, "--timeout", "1.5", "--period-ms", "100")
    assert p.returncode == 1 and 1.5 <= took < 15, (p.returncode, took)
    assert h.url in p.stderr and "503" in p.stderr and "not ready after" in p.stderr, p.stderr
    assert len(h.answers) >= 5  # it kept asking every period
    # nothing listening at all: the same, with the connection error
    p, _ = wait_in(pod, "--url", h.url, "--timeout", "0.5", "--period-ms", "50")
    assert p.returncode == 1 and "refused" in p.stderr.lower(), p.stderr
    # bad usage: exit 2, naming the flag
    p, _ = wait_in(pod, "--url", "https://127.0.0.1/x", "--timeout", "1")
    assert p.returncode == 2 and "--url" in p.stderr, p.stderr
    p, _ = wait_in(pod, "--url", h.url, "--timeout", "0")
    assert p.returncode == 2 and "--timeout" in p.stderr, p.stderr


def test_a_ready_proxy_is_not_enough_while_capture_is_missing_or_differs(pod: Pod) -> None:
    with health(pod.name, ready_after=0) as h:
        # the proxy answers, but nothing is installed: not ready
        p, _ = wait_in(pod, "--url", h.url, "--netns", "/proc/self/ns/net", "--timeout", "1", "--period-ms", "100")
        assert p.returncode == 1 and "capture in /proc/self/ns/net" in p.stderr and "differs" in p.stderr, p.stderr
        assert not h.answers  # capture is checked first: the URL was never asked
        try:
            # installed while the hook waits: ready then
            result: dict[str, object] = {}
            t = threading.Thread(target=lambda: result.update(
                zip(("p", "took"), wait_in(pod, "--url", h.url, "--netns", pod.name, "--timeout", "20",
                                           "--period-ms", "100"), strict=True)))
            t.start()
            time.sleep(0.8)
            redirect.setup(pod.name)
            t.join(30)
            p2 = result["p"]
            assert isinstance(p2, subprocess.CompletedProcess) and p2.returncode == 0, result
            assert isinstance(result["took"], float) and result["took"] >= 0.8
            # installed, but not the config the hook waits for (one excluded port more): not ready
            p, _ = wait_in(pod, "--url", "", "--netns", pod.name, "--set", "outbound_exclude_ports=22",
                           "--timeout", "0.5", "--period-ms", "100")
            assert p.returncode == 1 and "differs" in p.stderr and "22" in p.stderr, p.stderr
            # the validation probe (nothing listens on the inbound port yet): capture really works
            p, _ = wait_in(pod, "--url", "", "--netns", pod.name, "--validate", "--timeout", "10")
            assert p.returncode == 0, p.stderr
        finally:
            redirect.teardown(pod.name)


def test_capture_of_any_backend_is_compared_as_check_compares_it(pod: Pod) -> None:
    # without --backend, the capture installed there by whichever backend; with one, only that backend's
    redirect.setup(pod.name, backend="nftables")
    try:
        p, _ = wait_in(pod, "--url", "", "--netns", pod.name, "--timeout", "5", "--period-ms", "100")
        assert p.returncode == 0 and "ready: capture in" in p.stdout, p.stderr
        p, _ = wait_in(pod, "--url", "", "--netns", pod.name, "--backend", "iptables", "--timeout", "0.5",
                       "--period-ms", "100")
        assert p.returncode == 1 and "differs" in p.stderr and "iptables" in p.stderr, p.stderr
        assert wait.wait(url=None, netns=pod.name, timeout=5).ok
    finally:
        redirect.teardown(pod.name)
