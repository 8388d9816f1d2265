"""HTTP requests written by hand on a socket, for what a client library will not send: a body
that stops half way (a Content-Length of 100 MB with 64 KiB sent, a chunked body with no end).
The answer is read as soon as it comes, so a server that waits for the whole body times out."""

from __future__ import annotations

import socket
from collections.abc import Iterable


def request(port: int, path: str, headers: dict[str, str], body: Iterable[bytes],
            timeout: float = 30.0) -> tuple[int, bytes]:
    """(status, response body) of a POST to 127.0.0.1:`port` whose body is the parts of
    `body`, sent one by one (no more than that, whatever the headers promise)."""
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.encode())
        for part in body:
            try:
                s.sendall(part)
            except (BrokenPipeError, ConnectionResetError):  # the server answered and closed
                break
        return _response(s)


def chunked(parts: Iterable[bytes]) -> Iterable[bytes]:
    """`parts` in the chunked transfer coding, without the last (empty) chunk."""
    for part in parts:
        yield f"{len(part):x}\r\n".encode() + part + b"\r\n"


def _response(s: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        data += _recv(s)
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    fields = {k.strip().lower(): v.strip()
              for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(fields.get("content-length", "0"))
    while len(rest) < length:
        rest += _recv(s)
    return status, rest[:length]


def _recv(s: socket.socket) -> bytes:
    chunk = s.recv(65536)
    if not chunk:
        raise ConnectionError("the server closed the connection before answering")
    return chunk
