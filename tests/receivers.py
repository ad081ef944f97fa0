"""Real alert receivers on 127.0.0.1 for the tests: an HTTP server where a Slack-style incoming
webhook would be, and an SMTP server (aiosmtpd)."""

from __future__ import annotations

import email
import email.message
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class WebhookReceiver:
    """Records every POSTed JSON body (`posts`) and its path (`paths`); answers `status`."""

    def __init__(self, path: str = "/services/T000/B000/test-hook", status: int = 200) -> None:
        self.posts: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.status = status
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.paths.append(self.path)
                receiver.posts.append(json.loads(body))
                self.send_response(receiver.status)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{path}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Inbox:
    """An aiosmtpd handler that keeps every message and envelope it receives."""

    def __init__(self) -> None:
        self.messages: list[email.message.Message] = []
        self.envelopes: list[Any] = []

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd's name
        self.envelopes.append(envelope)
        self.messages.append(email.message_from_bytes(envelope.content))
        return "250 Message accepted for delivery"
