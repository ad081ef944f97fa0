"""Alerts reach a real webhook receiver and a real SMTP server (aiosmtpd) on 127.0.0.1, and an
alert that cannot be delivered is logged without its secrets and never raises."""

from __future__ import annotations

import logging

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult, LoginPassword

from budget_sidecar.testing import free_port
from receivers import Inbox, WebhookReceiver
from x1_common.alerts import AlertSender

WEBHOOK_TOKEN = "T000/B000/hooksecret9931"
SMTP_PASSWORD = "smtp-pass-4417"


@pytest.fixture
def webhook():
    r = WebhookReceiver(path=f"/services/{WEBHOOK_TOKEN}")
    yield r
    r.close()


@pytest.fixture
def smtpd():
    inbox = Inbox()
    logins: list[tuple[str, str]] = []

    def authenticator(server, session, envelope, mechanism, auth_data):
        if isinstance(auth_data, LoginPassword):
            logins.append((auth_data.login.decode(), auth_data.password.decode()))
            return AuthResult(success=auth_data.password.decode() == SMTP_PASSWORD)
        return AuthResult(success=False)

    controller = Controller(inbox, hostname="127.0.0.1", port=free_port(), authenticator=authenticator,
                            auth_require_tls=False)
    controller.start()
    inbox.port = controller.port
    inbox.logins = logins
    yield inbox
    controller.stop()


def smtp_env(port: int, **extra: str) -> dict[str, str]:
    return {"SMTP_HOST": "127.0.0.1", "SMTP_PORT": str(port), "SMTP_FROM": "x1@example.org",
            "SMTP_TO": "ops@example.org, me@example.org", **extra}


def test_an_alert_reaches_the_webhook_and_the_mailbox(webhook: WebhookReceiver, smtpd: Inbox) -> None:
    sender = AlertSender.from_env({"SLACK_WEBHOOK_URL": webhook.url, **smtp_env(smtpd.port)})
    delivered = sender.send("alert-line", "Budget: $30.40 spent", "over the $30.00 alert line", {"cap_usd": 35})
    assert delivered == ["webhook", "email"]
    assert len(webhook.posts) == 1
    text = webhook.posts[0]["text"]
    assert "Budget: $30.40 spent" in text and "alert line" in text
    assert webhook.posts[0]["attachments"][0]["fields"][0] == {"title": "cap_usd", "value": "35", "short": True}
    assert len(smtpd.messages) == 1
    msg = smtpd.messages[0]
    assert "Budget: $30.40 spent" in msg["Subject"] and msg["X-X1-Alert-Kind"] == "alert-line"
    assert smtpd.envelopes[0].rcpt_tos == ["ops@example.org", "me@example.org"]
    assert "cap_usd: 35" in msg.get_payload()


def test_smtp_login_uses_user_and_password(smtpd: Inbox) -> None:
    sender = AlertSender.from_env(smtp_env(smtpd.port, SMTP_USER="x1bot", SMTP_PASSWORD=SMTP_PASSWORD))
    assert sender.send("stale", "Budget data stale", "no reading for 20 min") == ["email"]
    assert smtpd.logins == [("x1bot", SMTP_PASSWORD)]


def test_starttls_is_required_when_asked(smtpd: Inbox, caplog: pytest.LogCaptureFixture) -> None:
    # This server offers no STARTTLS: with SMTP_STARTTLS=1 the sender refuses to send in clear.
    sender = AlertSender.from_env(smtp_env(smtpd.port, SMTP_STARTTLS="1", SMTP_USER="x1bot", SMTP_PASSWORD=SMTP_PASSWORD))
    with caplog.at_level(logging.ERROR, logger="x1.alerts"):
        assert sender.send("rate", "Rate high", "3x the plan") == []
    assert smtpd.messages == [] and smtpd.logins == []
    assert "STARTTLS" in caplog.text or "starttls" in caplog.text.lower()


def test_undeliverable_alerts_are_logged_without_secrets_and_never_raise(caplog: pytest.LogCaptureFixture) -> None:
    dead = free_port()  # nothing listens there
    env = {"SLACK_WEBHOOK_URL": f"http://127.0.0.1:{dead}/services/{WEBHOOK_TOKEN}",
           **smtp_env(dead, SMTP_USER="x1bot", SMTP_PASSWORD=SMTP_PASSWORD)}
    sender = AlertSender.from_env(env, timeout_s=3.0)
    with caplog.at_level(logging.INFO):
        assert sender.send("alert-line", "Budget: $31 spent", "over the line") == []
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2 and "webhook" in caplog.text and "email" in caplog.text
    assert WEBHOOK_TOKEN not in caplog.text and SMTP_PASSWORD not in caplog.text
    assert WEBHOOK_TOKEN not in repr(sender) and SMTP_PASSWORD not in repr(sender)


def test_a_webhook_answering_an_error_status_is_logged_without_its_url(webhook: WebhookReceiver,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    webhook.status = 404
    with caplog.at_level(logging.ERROR, logger="x1.alerts"):
        assert AlertSender.from_env({"SLACK_WEBHOOK_URL": webhook.url}).send("rate", "Rate", "high") == []
    assert "HTTP 404" in caplog.text and WEBHOOK_TOKEN not in caplog.text


def test_with_no_channel_the_alert_is_still_logged(caplog: pytest.LogCaptureFixture) -> None:
    sender = AlertSender.from_env({})
    assert sender.channels == []
    with caplog.at_level(logging.WARNING, logger="x1.alerts"):
        assert sender.send("stale", "Budget data stale", "sidecar silent") == []
    assert "Budget data stale" in caplog.text


@pytest.mark.parametrize("env, named", [
    ({"SMTP_HOST": "mail.example.org"}, "SMTP_TO"),
    ({"SMTP_HOST": "mail.example.org", "SMTP_TO": "a@b.c", "SMTP_PORT": "smtp"}, "SMTP_PORT"),
    ({"SLACK_WEBHOOK_URL": "hooks.example/" + WEBHOOK_TOKEN}, "SLACK_WEBHOOK_URL"),
])
def test_half_configured_channels_are_errors_naming_the_variable(env: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named) as e:
        AlertSender.from_env(env)
    assert WEBHOOK_TOKEN not in str(e.value)
