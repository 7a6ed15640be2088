"""`hybridjit serve` with one slot and a queue of one: a burst of requests beyond them is turned away with 429
and Retry-After; SIGTERM lets the request in flight end and the server exit. The SIGTERM test ends the server:
it is this module's last."""

import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_process import serve

LONG = {"prompt": "def f(x):", "max_tokens": 1000, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("server"), "--slots", "1", "--max-queue", "1") as server:
        yield server


def test_requests_beyond_the_slots_and_the_queue_get_429_with_retry_after(server):
    # Eight at once: one runs, one waits, and the rest arrive while the first still runs (its first compiled
    # program alone takes seconds here, and then a thousand tokens).
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: server.post("/v1/completions", json=LONG), range(8)))
    statuses = sorted(r.status_code for r in responses)
    assert statuses[:2] == [200, 200] and set(statuses[2:]) == {429}, statuses
    for response in responses:
        if response.status_code == 429:
            assert int(response.headers["Retry-After"]) >= 1
            assert "queue" in response.json()["error"]["message"]
    server.wait_for(lambda m: m["hybridjit_requests_rejected_total"] == 6, "the count of rejections")


def test_sigterm_lets_the_request_in_flight_end_and_exits(server):
    # Two thousand tokens take this machine (~5 ms a token) past the grace period: the request is cancelled.
    longest = {**LONG, "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=longest, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: {")
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    # The stream ended as a whole: finished, or cancelled after the grace period with an error event.
    assert rest[-1] == "data: [DONE]" or "the request ended early (cancelled)" in rest[-1], rest[-3:]
    assert server.proc.wait(timeout=60) == -signal.SIGTERM  # uvicorn re-raises the signal once it is done
    log = server.log.read_text()
    assert "Application shutdown complete" in log and "Traceback" not in log
