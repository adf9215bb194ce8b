"""The agents' chat server over HTTP: malformed requests sent on raw sockets and bodies the API
does not allow get 4xx with OpenAI's error body and no traceback in the log; concurrent calls of
one run are one engine request each (the real embedded engine, a tiny model), and an abort
reaches every call in flight."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import urllib.error
import urllib.request

import pytest

from agent_helpers import RecordingEngine, write_tokenizer

from megatron_rl.config.schema import ModelConfig
from megatron_rl.types import SamplingParams

PATH = "/runs/r1/v1/chat/completions"
GOOD = {"model": "policy", "messages": [{"role": "user", "content": "What is 2 + 3?"}]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from megatron_rl.data.tokenizer import load_pretrained_tokenizer

    path = tmp_path_factory.mktemp("chat_tokenizer")
    write_tokenizer(path)
    return load_pretrained_tokenizer(str(path))


@pytest.fixture(scope="module")
def engine(megatron_world, tokenizer):
    import torch

    from megatron_rl.rollout.embedded import EmbeddedEngine

    torch.manual_seed(0)
    return EmbeddedEngine(ModelConfig(max_position_embeddings=256), tokenizer.vocab_size, max_batch_size=64, seed=0)


def _serve(engine, tokenizer, work, **kwargs):
    """Run ``work(server, run)`` against a started server with run ``r1`` open."""
    from megatron_rl.rollout.agent.server import ChatServer

    async def main():
        server = ChatServer(engine, tokenizer, 256, **kwargs)
        await server.start()
        run = server.open_run("r1", SamplingParams(max_new_tokens=4))
        try:
            return await work(server, run)
        finally:
            await server.stop()

    return asyncio.run(main())


def _raw(port: int, data: bytes, half_close: bool = False) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


def _status_and_error(answer: bytes):
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return status, error


def _no_traceback(caplog):
    for record in caplog.records:
        assert record.exc_info is None and "Traceback" not in record.getMessage(), record.getMessage()


BODY = json.dumps(GOOD).encode()
MALFORMED = {
    "no method": b"/runs/r1/v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n",
    "no path": b"POST\r\nHost: x\r\n\r\n",
    "negative Content-Length": f"POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n".encode(),
    "non-numeric Content-Length": f"POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n".encode(),
    "100 KB header": f"POST {PATH} HTTP/1.1\r\nHost: x\r\nX-Big: {'a' * 100_000}\r\n\r\n".encode(),
    "truncated body": f"POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(BODY)}\r\n\r\n".encode() + BODY[:10],
    "200 headers": f"POST {PATH} HTTP/1.1\r\n".encode() + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n",
    "TLS on the port": b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n",
}


def test_malformed_http_gets_400_with_an_openai_error_and_no_traceback(engine, tokenizer, caplog):
    caplog.set_level(logging.DEBUG)

    async def work(server, run):
        answers = {name: await asyncio.to_thread(_raw, server.port, data, half_close=True)
                   for name, data in MALFORMED.items()}
        # A body cut short by a client that keeps its side open is answered at the body timeout.
        answers["stalled body"] = await asyncio.to_thread(_raw, server.port, MALFORMED["truncated body"])
        return answers

    answers = _serve(engine, tokenizer, work, body_timeout_s=0.5)
    for name, answer in answers.items():
        status, error = _status_and_error(answer)
        assert status == 400 and error["type"] == "invalid_request_error", (name, answer[:300])
    assert "the body is truncated: 10 of" in _status_and_error(answers["truncated body"])[1]["message"]
    assert "nothing for 0.5 s" in _status_and_error(answers["stalled body"])[1]["message"]
    assert "malformed HTTP request" in _status_and_error(answers["no method"])[1]["message"]
    assert "answered 400 to a request it could not read" in caplog.text
    _no_traceback(caplog)


def _post(port: int, body, path: str = PATH, method: str = "POST"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data if method == "POST" else None,
                                     method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


REFUSED = [
    (b"", 400, "the body is empty"),
    (b"{not json", 400, "the body is not JSON"),
    (b"{\"model\": \"\xff\"}", 400, "not UTF-8"),
    ([GOOD], 400, "the body must be a JSON object"),
    ({**GOOD, "messages": ["hello"]}, 400, "messages[0] must be an object"),
    ({**GOOD, "messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ({**GOOD, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({**GOOD, "messages": []}, 400, "non-empty array"),
    ({**GOOD, "model": "gpt-4o"}, 400, "model \"gpt-4o\" is not served here; the served model is 'policy' (what GET "
                                       "/v1/models lists; 'default' names it too)"),
    ({k: v for k, v in GOOD.items() if k != "model"}, 400, "no 'model'"),
    ({**GOOD, "max_tokens": 0}, 400, "max_tokens=0 is invalid: it must be an integer of at least 1"),
    ({**GOOD, "max_completion_tokens": -1}, 400, "max_completion_tokens=-1"),
    ({**GOOD, "max_tokens": "5"}, 400, "max_tokens=\"5\""),
    ({**GOOD, "tools": "x"}, 400, "'tools' must be an array"),
    ({**GOOD, "tools": [{"type": "function"}]}, 400, "tools[0] must be an object"),
    ({**GOOD, "stream": True}, 400, "stream=true is not supported"),
    ({**GOOD, "n": 2}, 400, "n must be 1"),
]


def test_bodies_the_api_does_not_allow_are_refused_in_one_line(engine, tokenizer, caplog):
    caplog.set_level(logging.DEBUG)

    async def work(server, run):
        answers = [await asyncio.to_thread(_post, server.port, body) for body, _, _ in REFUSED]
        answers.append(await asyncio.to_thread(_post, server.port, b"", method="GET"))
        answers.append(await asyncio.to_thread(_post, server.port, GOOD, path="/runs/r1/v1/embeddings"))
        answers.append(await asyncio.to_thread(_post, server.port, GOOD, path="/runs/nope/v1/chat/completions"))
        models = await asyncio.to_thread(_post, server.port, b"", path="/runs/r1/v1/models", method="GET")
        return answers, models, run.calls

    answers, models, calls = _serve(engine, tokenizer, work)
    expected = [(status, text) for _, status, text in REFUSED] + [(405, "use POST"), (404, "no endpoint"),
                                                                  (404, "'nope' is not open")]
    for (status, body), (want, text) in zip(answers, expected):
        assert status == want and text in body["error"]["message"], (body, text)
        assert set(body["error"]) == {"message", "type", "param", "code"}
    assert answers[REFUSED.index(next(r for r in REFUSED if r[2].startswith("max_tokens=0")))][1]["error"][
        "param"] == "max_tokens"
    assert models == (200, {"object": "list", "data": [{"id": "policy", "object": "model", "created": 0,
                                                        "owned_by": "megatron_rl"}]})
    assert calls == 0  # nothing refused reached the engine
    _no_traceback(caplog)


def test_concurrent_calls_of_one_run_are_one_engine_request_each(engine, tokenizer):
    from openai import AsyncOpenAI

    recording = RecordingEngine(engine)

    async def work(server, run):
        client = AsyncOpenAI(base_url=server.base_url("r1"), api_key="x", max_retries=0)
        replies = await asyncio.gather(*(client.chat.completions.create(
            model="policy", max_tokens=3, messages=[{"role": "user", "content": f"What is {i} + 1?"}])
            for i in range(50)))
        await client.close()
        return replies, run

    replies, run = _serve(recording, tokenizer, work)
    ids = [rid for rid, _, _ in recording.calls]
    assert len(ids) == len(set(ids)) == 50 and set(ids) == {f"r1-t{k}" for k in range(50)}
    assert len(run.turns) == 50 and not run.in_flight
    assert all(r.usage.completion_tokens <= 3 for r in replies)


async def _calls_ended_while_waiting(engine, server, run, calls: int, end):
    """``calls`` concurrent chat calls of ``run``, held in the paused engine until ``end()`` ends
    them; what each call raised or returned."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.base_url("r1"), api_key="x", max_retries=0)
    await engine.pause()  # the calls wait in the engine until they are aborted
    try:
        pending = [asyncio.ensure_future(client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": f"Count to {i}."}])) for i in range(calls)]
        while len(run.in_flight) < calls:
            await asyncio.sleep(0.01)
        await end()
        return await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 60)
    finally:
        await engine.resume()
        await client.close()


@pytest.mark.parametrize("how", ["abort_run", "engine abort of one call"])
def test_an_abort_reaches_every_call_in_flight(engine, tokenizer, how):
    from openai import ConflictError

    async def work(server, run):
        async def end():
            if how == "abort_run":
                await server.abort_run(run)
            else:  # the engine ends one call: the run is void, so the server aborts the other 49
                await engine.abort(["r1-t17"])

        return await _calls_ended_while_waiting(engine, server, run, 50, end), run

    results, run = _serve(engine, tokenizer, work)
    assert all(isinstance(r, ConflictError) for r in results), results
    assert all(r.body["code"] == "aborted" and "was aborted by the trainer" in r.body["message"] for r in results)
    assert run.aborted and not run.turns and not run.in_flight


def test_calls_left_running_when_the_agent_returns_are_aborted_and_not_recorded(engine, tokenizer):
    from openai import ConflictError

    async def work(server, run):
        async def end():
            server.close_run("r1")  # what the workflow does when the agent returns
            await server.abort_run(run, void=False)

        return await _calls_ended_while_waiting(engine, server, run, 5, end), run

    results, run = _serve(engine, tokenizer, work)
    assert all(isinstance(r, ConflictError) and r.body["code"] == "run_closed" for r in results), results
    assert not run.aborted and not run.turns



def _post_with(port: int, path: str, headers: dict, body: dict):
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def test_the_shared_url_finds_the_run_by_its_key_or_header_and_refuses_a_call_naming_none(engine, tokenizer):
    """What a client that is not the run's own sends: the shared /v1 with the run's API key
    (AReaL's session keys) or the run header; with neither, a 404 saying how to reach a run.
    Refusals tell the openai client not to retry. The bodies ask for n=2, so a call that finds
    its run is refused after the routing (400), before the engine (this module's engine
    generates on one event loop only)."""
    body = {**GOOD, "model": "default", "n": 2}  # "default": AReaL's name for the served model

    async def work(server, run):
        path = "/v1/chat/completions"
        sent = [{"Authorization": "Bearer megatron_rl-r1"}, {"X-Megatron-RL-Run": "r1"},
                {"Authorization": "Bearer megatron_rl"}, {"Authorization": "Bearer megatron_rl-r2"}]
        answers = [await asyncio.to_thread(_post_with, server.port, path, headers, body) for headers in sent]
        return answers, run.requests

    (by_key, by_header, neither, other), requests = _serve(engine, tokenizer, work)
    for status, headers, answer in (by_key, by_header):
        assert status == 400 and answer["error"]["message"].startswith("n must be 1"), answer
        assert headers["x-should-retry"] == "false"
    assert requests == 2
    status, headers, answer = neither
    assert status == 404 and answer["error"]["code"] == "no_run" and headers["x-should-retry"] == "false"
    assert answer["error"]["message"].startswith("/v1/chat/completions names no agent run: call from inside a run")
    assert other[0] == 404 and "run 'r2' is not open" in other[2]["error"]["message"]
