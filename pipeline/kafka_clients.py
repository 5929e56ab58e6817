"""How every Sluice Kafka client connects: the one place security options are turned into client options.

Workers, routers, collectors, the OpenTelemetry bridge, the producer and the bench all build their
aiokafka clients (and the worker its Faust app) with the options below, so one set of settings —
``kafka_security_protocol``, ``kafka_sasl_*``, ``kafka_ssl_*`` (consistency checked by ``Settings``) —
makes every connection authenticated and encrypted. Neither aiokafka nor Faust is imported here until
``faust_credentials`` is called, so the router library stays free of Kafka imports until it connects.
"""

from __future__ import annotations

import functools
import logging
import os
import ssl
from typing import TYPE_CHECKING, Any

from .settings import KAFKA_SASL_PROTOCOLS, KAFKA_TLS_PROTOCOLS, SettingsError, _loopback

if TYPE_CHECKING:
    from .settings import Settings

log = logging.getLogger(__name__)


class Secret(str):
    """A password that prints as ``***``: an options dict that reaches a log or a traceback shows no secret."""

    def __repr__(self) -> str:
        return "'***'"


def ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """The TLS context of every Kafka connection (None without TLS): TLS 1.2 or later, the brokers verified
    against ``kafka_ssl_ca_file`` (else the system trust store), the client certificate when set.
    Built once per process for the same files; a file that does not load fails with the setting's name."""
    if settings.kafka_security_protocol not in KAFKA_TLS_PROTOCOLS:
        return None
    return _context(settings.kafka_ssl_ca_file, settings.kafka_ssl_cert_file, settings.kafka_ssl_key_file,
                    settings.kafka_ssl_check_hostname)


@functools.lru_cache(maxsize=8)
def _context(ca_file: str, cert_file: str, key_file: str, check_hostname: bool) -> ssl.SSLContext:
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH,
                                             cafile=os.path.expanduser(ca_file) if ca_file else None)
    except (OSError, ssl.SSLError) as exc:
        raise SettingsError(f"setting kafka_ssl_ca_file={ca_file!r}: not a PEM CA bundle ({exc})") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = check_hostname
    if cert_file:
        try:
            context.load_cert_chain(os.path.expanduser(cert_file), os.path.expanduser(key_file),
                                    password=_no_passphrase)
        except (OSError, ssl.SSLError) as exc:
            raise SettingsError(f"settings kafka_ssl_cert_file={cert_file!r}, kafka_ssl_key_file={key_file!r}: "
                                f"not a PEM certificate and its private key ({exc})") from None
    return context


def _no_passphrase() -> str:
    """Called by OpenSSL for an encrypted key: refuse, rather than let it prompt on the terminal."""
    raise SettingsError("kafka_ssl_key_file is encrypted: give Sluice an unencrypted key file (mode 0600)")


def client_options(settings: Settings) -> dict[str, Any]:
    """aiokafka keyword arguments (producer, consumer, admin client) for the configured security;
    empty with ``PLAINTEXT``, so aiokafka's defaults apply."""
    protocol = settings.kafka_security_protocol
    if protocol == "PLAINTEXT":
        return {}
    options: dict[str, Any] = {"security_protocol": protocol}
    if protocol in KAFKA_SASL_PROTOCOLS:
        options.update(sasl_mechanism=settings.kafka_sasl_mechanism,
                       sasl_plain_username=settings.kafka_sasl_username,
                       sasl_plain_password=Secret(settings.kafka_sasl_password))
    if protocol in KAFKA_TLS_PROTOCOLS:
        options["ssl_context"] = ssl_context(settings)
    else:
        _warn_cleartext(settings.kafka_bootstrap_servers, settings.kafka_sasl_mechanism)
    return options


def producer_options(settings: Settings) -> dict[str, Any]:
    """``client_options`` and what every Sluice producer needs: acknowledged by every in-sync replica, and
    idempotent, so a retried send is never written twice."""
    return {**client_options(settings), "acks": "all", "enable_idempotence": True}


def faust_credentials(settings: Settings) -> Any:
    """``faust.App(broker_credentials=...)``: the same connection for Faust's own consumer, producer and
    topic creation (``credentials_to_aiokafka_auth`` maps it back to the options above); None = PLAINTEXT."""
    import faust

    protocol = settings.kafka_security_protocol
    if protocol == "PLAINTEXT":
        return None
    if protocol == "SSL":
        return faust.SSLCredentials(ssl_context(settings))
    # SASLCredentials speaks SASL_SSL when given a context, SASL_PLAINTEXT without
    return faust.SASLCredentials(username=settings.kafka_sasl_username,
                                 password=Secret(settings.kafka_sasl_password),
                                 ssl_context=ssl_context(settings), mechanism=settings.kafka_sasl_mechanism)


@functools.lru_cache(maxsize=None)
def _warn_cleartext(bootstrap: str, mechanism: str) -> None:
    hosts = [server.rsplit(":", 1)[0].strip("[] ") for server in bootstrap.split(",") if server.strip()]
    remote = [host for host in hosts if not _loopback(host)]
    if remote:
        log.warning("kafka_security_protocol=SASL_PLAINTEXT to %s: records travel unencrypted%s; use SASL_SSL",
                    ", ".join(remote), " and PLAIN sends the password itself" if mechanism == "PLAIN" else "")
