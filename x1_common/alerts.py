"""Alerts to a person: a Slack-style webhook and email. Used by the budget guard and the watchdog.

    alerts = AlertSender.from_env()          # SLACK_WEBHOOK_URL, SMTP_HOST/PORT/USER/PASSWORD/FROM/TO
    alerts.send("alert-line", "Budget: $30.40 spent", "over the $30 alert line", {"cap_usd": 35})

`send` never raises: an alert that cannot be delivered is logged (without the webhook URL or the
SMTP password, both secrets) and the run goes on. Every alert is also logged as a warning, so it
is in the logs even with no channel configured. Standard library only; httpx is imported when a
webhook is actually posted.
"""

from __future__ import annotations

import logging
import os
import smtplib
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from email.message import EmailMessage
from typing import Any
from urllib.parse import urlsplit

from x1_common.contracts import redact

log = logging.getLogger("x1.alerts")


@dataclass(frozen=True)
class SmtpSettings:
    host: str
    port: int
    sender: str
    recipients: tuple[str, ...]
    user: str | None = None
    password: str | None = field(default=None, repr=False)  # a secret: never in repr or logs
    starttls: bool = False


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


class AlertSender:
    def __init__(
        self,
        webhook_url: str | None = None,
        smtp: SmtpSettings | None = None,
        *,
        timeout_s: float = 10.0,
        source: str = "X1",
    ) -> None:
        self._webhook_url = webhook_url or None  # a secret: whoever has it can post to the channel
        self.smtp = smtp
        self.timeout_s = timeout_s
        self.source = source

    def __repr__(self) -> str:
        return f"AlertSender(channels={self.channels})"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **kw: Any) -> AlertSender:
        """SLACK_WEBHOOK_URL; SMTP_HOST, SMTP_PORT (587 with STARTTLS, else 25), SMTP_USER, SMTP_PASSWORD,
        SMTP_FROM (default SMTP_USER), SMTP_TO (comma list), SMTP_STARTTLS=1.

        Unset variables mean no such channel. ValueError naming the variable for a half-configured
        one (SMTP_HOST without SMTP_TO, a port that is not a number, a webhook that is not a URL).
        """
        env = os.environ if environ is None else environ
        webhook = env.get("SLACK_WEBHOOK_URL", "").strip() or None
        if webhook and not webhook.startswith(("http://", "https://")):
            raise ValueError("SLACK_WEBHOOK_URL must be an http(s) URL")  # the value itself is a secret
        smtp = None
        host = env.get("SMTP_HOST", "").strip()
        if host:
            starttls = _flag(env.get("SMTP_STARTTLS"))
            port_text = env.get("SMTP_PORT", "").strip() or ("587" if starttls else "25")
            try:
                port = int(port_text)
            except ValueError:
                raise ValueError(f"SMTP_PORT must be a port number, got {port_text!r}") from None
            if not 0 < port < 65536:
                raise ValueError(f"SMTP_PORT must be 1..65535, got {port}")
            recipients = tuple(a.strip() for a in env.get("SMTP_TO", "").split(",") if a.strip())
            if not recipients:
                raise ValueError("SMTP_TO is required when SMTP_HOST is set (comma-separated addresses)")
            user = env.get("SMTP_USER", "").strip() or None
            sender = env.get("SMTP_FROM", "").strip() or user or f"x1@{socket.gethostname()}"
            smtp = SmtpSettings(
                host=host, port=port, sender=sender, recipients=recipients, user=user,
                password=env.get("SMTP_PASSWORD") or None, starttls=starttls,
            )
        return cls(webhook, smtp, **kw)

    @property
    def channels(self) -> list[str]:
        return [name for name, on in (("webhook", self._webhook_url), ("email", self.smtp)) if on]

    def send(self, kind: str, subject: str, body: str, fields: Mapping[str, Any] | None = None) -> list[str]:
        """Deliver to every configured channel; returns those that delivered. Never raises."""
        fields = dict(fields or {})
        log.warning("ALERT [%s] %s: %s", kind, subject, body)
        delivered = []
        for channel, deliver in (("webhook", self._post_webhook), ("email", self._send_email)):
            if channel not in self.channels:
                continue
            try:
                deliver(kind, subject, body, fields)
                delivered.append(channel)
            except Exception as e:  # an alert must never stop the run
                log.error("alert [%s] not delivered by %s: %s", kind, channel, self._describe(e))
        return delivered

    def _describe(self, e: BaseException) -> str:
        """The failure in words that carry no secret (httpx puts the URL in its messages)."""
        text = f"{type(e).__name__}: {e}"
        for secret in (self._webhook_url, self.smtp.password if self.smtp else None):
            if secret:
                text = text.replace(secret, "***")
        return redact(text)

    def _post_webhook(self, kind: str, subject: str, body: str, fields: dict[str, Any]) -> None:
        import httpx

        # Slack's incoming-webhook format; Mattermost and Rocket.Chat accept the same payload.
        payload = {
            "text": f"*[{self.source}] {subject}*\n{body}",
            "attachments": [{
                "fields": [{"title": k, "value": str(v), "short": True} for k, v in fields.items()],
                "footer": f"alert kind: {kind}",
            }],
        }
        try:
            resp = httpx.post(self._webhook_url or "", json=payload, timeout=self.timeout_s)
        except httpx.HTTPError as e:
            host = urlsplit(self._webhook_url or "").hostname
            raise RuntimeError(f"{type(e).__name__} posting to {host}") from None
        if resp.status_code >= 300:
            host = urlsplit(self._webhook_url or "").hostname
            raise RuntimeError(f"HTTP {resp.status_code} from {host}")

    def _send_email(self, kind: str, subject: str, body: str, fields: dict[str, Any]) -> None:
        s = self.smtp
        assert s is not None
        msg = EmailMessage()
        msg["Subject"] = f"[{self.source}] {subject}"
        msg["From"] = s.sender
        msg["To"] = ", ".join(s.recipients)
        msg["X-X1-Alert-Kind"] = kind
        lines = [body, ""] + [f"{k}: {v}" for k, v in fields.items()]
        msg.set_content("\n".join(lines).rstrip() + "\n")
        with smtplib.SMTP(s.host, s.port, timeout=self.timeout_s) as smtp:
            if s.starttls:
                smtp.starttls(context=ssl.create_default_context())
            if s.user and s.password:
                smtp.login(s.user, s.password)
            smtp.send_message(msg)
