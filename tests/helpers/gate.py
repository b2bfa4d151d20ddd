"""A TCP gate on loopback in front of a server (the session's MLflow server): a test shuts it (new connections
refused, open ones cut: the server is down for its clients) and opens it again on the same port, without
touching the server the other tests share."""

from __future__ import annotations

import contextlib
import socket
import threading

from helpers.jobs import free_port


class Gate:
    def __init__(self, target_port: int):
        self.target, self.port = target_port, free_port()
        self._listener: socket.socket | None = None
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self.open()

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def open(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def shut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._open = self._open, []
        for s in [listener, *conns]:
            if s is not None:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)  # wakes the accept and the pumps
                s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                return
            with self._lock:
                self._open += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)
