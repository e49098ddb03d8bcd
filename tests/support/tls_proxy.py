"""TLS-terminating proxies for the tests, in front of the session's plain PostgreSQL and Redis.

The servers the suite runs (embedded ones, or those DATABASE_URL and REDIS_URL name) speak no TLS:
the embedded builds have none. A proxy here takes the client's TLS, with a certificate the test
made, and forwards the decrypted bytes to the plain server, so a client configured for verified
TLS is tested end to end against the real server behind it. A client that speaks plain text to a
proxy is refused, never forwarded: one that silently fell back to plain text fails its test.

Redis clients start TLS at once. PostgreSQL negotiates it in-band: the client first sends an
SSLRequest, the server answers `S`, and only then does the handshake begin; the plain server behind
the proxy never sees the SSLRequest, only the startup that follows it, decrypted.
"""

from __future__ import annotations

import contextlib
import itertools
import selectors
import socket
import ssl
import struct
import threading
from collections.abc import Callable

# PostgreSQL's in-band requests: eight bytes, a length of 8 and one of these codes.
SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104
TLS_HANDSHAKE_RECORD = 0x16  # the first byte of a TLS ClientHello
CHUNK = 65536


class PlainText(Exception):
    """The client spoke plain text: refused, with `answer` to tell it why."""

    def __init__(self, answer: bytes) -> None:
        super().__init__(answer)
        self.answer = answer


class TlsProxy:
    """Listens on a free port of 127.0.0.1 (`address`). For each connection: `negotiate` on the
    plain socket (True: go on with TLS; False: the client left; PlainText: refused), the TLS
    handshake as the server, then forwarding both ways between the client and `upstream`. A thread
    per connection and one that accepts, all daemons, all ended by close()."""

    def __init__(
        self, upstream: tuple[str, int], context: ssl.SSLContext, negotiate: Callable[[socket.socket], bool]
    ) -> None:
        self.upstream = upstream
        self.context = context
        self.negotiate = negotiate
        # Completed handshakes: what a test reads to know its traffic really went over TLS.
        self.handshakes = 0
        # Connections refused for speaking plain text, and handshakes the client gave up (it did
        # not trust the certificate).
        self.refused = 0
        self.failed_handshakes = 0
        # Bytes the clients sent on to the server, decrypted: none, where a client refused the
        # certificate (libpq checks the name only once the handshake is done, then leaves).
        self.forwarded = 0
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._start(self._accept, "accept")

    @property
    def port(self) -> int:
        return self.address[1]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            held = list(self._sockets)
        # A shutdown wakes the threads blocked in accept() or select() on these sockets at once;
        # each connection's thread then closes its own.
        for sock in [self._listener, *held]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for thread in self._threads:
            thread.join(10)

    def __enter__(self) -> TlsProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self, target: Callable[..., None], name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=f"tls-proxy-{name}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        for n in itertools.count():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            if not self._hold(conn):
                conn.close()
                return
            self._start(self._serve, f"connection-{n}", conn)

    def _hold(self, sock: socket.socket) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._sockets.add(sock)
            return True

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + n)

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            try:
                if not self.negotiate(client):
                    return
            except PlainText as refusal:
                # Counted before the client hears of it: a test reads the count once its client failed.
                self._count("refused")
                client.sendall(refusal.answer)
                return
            # One thread drives both directions through memory BIOs, so that no SSL object is
            # ever read and written from two threads at once (OpenSSL's objects are not
            # thread-safe).
            incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
            tls = self.context.wrap_bio(incoming, outgoing, server_side=True)
            if not _handshake(client, tls, incoming, outgoing):
                self._count("failed_handshakes")
                return
            self._count("handshakes")
            upstream = socket.create_connection(self.upstream)
            if not self._hold(upstream):
                return
            self._forward(client, upstream, tls, incoming, outgoing)
        except OSError:
            pass  # either side went away, or the proxy closed: the connection ends
        finally:
            for sock in (client, upstream):
                if sock is not None:
                    with self._lock:
                        self._sockets.discard(sock)
                    sock.close()

    def _forward(
        self,
        client: socket.socket,
        upstream: socket.socket,
        tls: ssl.SSLObject,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
    ) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(client, selectors.EVENT_READ)
            selector.register(upstream, selectors.EVENT_READ)
            while True:
                # What the client sent, decrypted: the handshake's last read may already hold
                # its first request.
                if not self._pass_decrypted(tls, upstream):
                    return  # the client closed its TLS session
                _flush(client, outgoing)
                for key, _ in selector.select():
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    data = sock.recv(CHUNK)
                    if not data:
                        return
                    if sock is client:
                        incoming.write(data)
                    else:
                        tls.write(data)
                        _flush(client, outgoing)

    def _pass_decrypted(self, tls: ssl.SSLObject, upstream: socket.socket) -> bool:
        """Whatever the client's records hold so far, sent on decrypted; False once it closed TLS."""
        while True:
            try:
                data = tls.read(CHUNK)
            except ssl.SSLWantReadError:
                return True
            except ssl.SSLZeroReturnError:
                return False
            if not data:
                return False
            self._count("forwarded", len(data))
            upstream.sendall(data)


def _handshake(client: socket.socket, tls: ssl.SSLObject, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO) -> bool:
    while True:
        try:
            tls.do_handshake()
        except ssl.SSLWantReadError:
            _flush(client, outgoing)
            data = client.recv(CHUNK)
            if not data:
                return False
            incoming.write(data)
        except ssl.SSLError:
            _flush(client, outgoing)  # the alert, so the client sees why
            return False
        else:
            _flush(client, outgoing)
            return True


def _flush(sock: socket.socket, outgoing: ssl.MemoryBIO) -> None:
    data = outgoing.read()
    if data:
        sock.sendall(data)


def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            return None
        data += more
    return data


def _postgres_error(message: str) -> bytes:
    # An ErrorResponse, so that a plain-text client reports why it was refused rather than a bare
    # closed connection: severity, SQLSTATE 08P01 (protocol violation), message.
    fields = b"SFATAL\0VFATAL\0C08P01\0M" + message.encode() + b"\0\0"
    return b"E" + struct.pack("!I", 4 + len(fields)) + fields


def negotiate_postgres(client: socket.socket) -> bool:
    """PostgreSQL's in-band start of TLS: `S` to an SSLRequest. A GSSENCRequest (libpq may send
    one first) is declined with `N`, after which the client asks for TLS; anything else is a plain
    startup message: PlainText."""
    while True:
        head = _recv_exactly(client, 8)
        if head is None:
            return False
        length, code = struct.unpack("!II", head)
        if length == 8 and code == GSSENC_REQUEST:
            client.sendall(b"N")
        elif length == 8 and code == SSL_REQUEST:
            client.sendall(b"S")
            return True
        else:
            raise PlainText(_postgres_error("this TLS proxy refuses plain-text connections"))


def negotiate_redis(client: socket.socket) -> bool:
    """Redis's TLS starts at the first byte: a ClientHello, or a plain-text command (PlainText)."""
    first = client.recv(1, socket.MSG_PEEK)
    if not first:
        return False
    if first[0] != TLS_HANDSHAKE_RECORD:
        raise PlainText(b"-ERR this TLS proxy refuses plain-text connections\r\n")
    return True


def postgres_proxy(upstream: tuple[str, int], context: ssl.SSLContext) -> TlsProxy:
    return TlsProxy(upstream, context, negotiate_postgres)


def redis_proxy(upstream: tuple[str, int], context: ssl.SSLContext) -> TlsProxy:
    return TlsProxy(upstream, context, negotiate_redis)
