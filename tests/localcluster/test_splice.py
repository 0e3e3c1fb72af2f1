"""A forwarded connection (a Service's proxy, a door into the cluster network) lives until both ends finish.

Once the client half-closes, asyncio stops watching the client's socket, and the server's reader is held by
its protocol only weakly: nothing the event loop holds leads to the task copying the answer back, and a
garbage collection in that moment destroyed it ("Task was destroyed but it is pending!"), dropping the
answer. A client that sends its request and shuts its side down (as `nc -N`, or an HTTP/1.0 client may) met it.
"""

from __future__ import annotations

import asyncio
import gc
import socket

from maru_localcluster.network import splice


async def _answer_after_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    request = await reader.read()  # to EOF: the client half-closed
    await asyncio.sleep(0.3)
    writer.write(b"answer to " + request)
    await writer.drain()
    writer.close()


async def _forward_to(port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    backend_r, backend_w = await asyncio.open_connection("127.0.0.1", port)
    await splice(reader, writer, backend_r, backend_w)


def _half_closing_client(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"question")
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(1024):
            answer += chunk
        return answer


def test_a_half_closed_connection_survives_a_garbage_collection_and_gets_its_answer() -> None:
    async def scenario() -> bytes:
        backend = await asyncio.start_server(_answer_after_eof, "127.0.0.1", 0)
        backend_port = backend.sockets[0].getsockname()[1]

        async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _forward_to(backend_port, reader, writer)

        front = await asyncio.start_server(forward, "127.0.0.1", 0)
        client = asyncio.get_running_loop().run_in_executor(
            None, _half_closing_client, front.sockets[0].getsockname()[1]
        )
        for _ in range(10):  # while the backend thinks, the forwarding task waits on it alone
            await asyncio.sleep(0.05)
            gc.collect()
        answer = await asyncio.wait_for(client, 10)
        front.close()
        backend.close()
        return answer

    assert asyncio.run(scenario()) == b"answer to question"
