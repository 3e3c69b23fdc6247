"""The OTLP resource of what Durable Check itself sends (violation spans, pushed metrics).

Defaults: ``service.name=durable-check`` and ``service.version``. The standard
OpenTelemetry environment variables add to them and win over them, as in every
OpenTelemetry SDK: ``OTEL_RESOURCE_ATTRIBUTES`` (comma-separated ``key=value`` pairs,
percent-encoded, e.g. ``service.instance.id=durable-check-0,deployment.environment=prod``,
so that several replicas pushing metrics can be told apart) and ``OTEL_SERVICE_NAME``
(which wins over a ``service.name`` in the former).

A malformed ``OTEL_RESOURCE_ATTRIBUTES`` is ignored as a whole, as the specification
asks, with a warning naming the entry by position (never its value).
"""

from __future__ import annotations

import logging
import os
import urllib.parse
from collections.abc import Mapping
from typing import Final

from processor._version import __version__

log = logging.getLogger("durable_check.exporters")

RESOURCE_ATTRIBUTES_ENV: Final = "OTEL_RESOURCE_ATTRIBUTES"
SERVICE_NAME_ENV: Final = "OTEL_SERVICE_NAME"
DEFAULT_SERVICE_NAME: Final = "durable-check"


class ResourceAttributesError(ValueError):
    """``OTEL_RESOURCE_ATTRIBUTES`` does not parse; the message names the entry by position."""


def parse_resource_attributes(text: str) -> dict[str, str]:
    """``key1=value1,key2=value2`` with percent-decoded keys and values; blanks around entries are ignored."""
    attributes: dict[str, str] = {}
    for position, raw in enumerate(text.split(","), start=1):
        entry = raw.strip()
        if not entry:
            continue
        key, sep, value = entry.partition("=")
        if not sep:
            raise ResourceAttributesError(f"{RESOURCE_ATTRIBUTES_ENV}: entry {position} is not key=value")
        try:
            key = urllib.parse.unquote(key.strip(), errors="strict")
            value = urllib.parse.unquote(value.strip(), errors="strict")
        except UnicodeDecodeError:
            raise ResourceAttributesError(
                f"{RESOURCE_ATTRIBUTES_ENV}: entry {position} is not valid percent-encoded UTF-8"
            ) from None
        if not key:
            raise ResourceAttributesError(f"{RESOURCE_ATTRIBUTES_ENV}: entry {position} has an empty key")
        attributes[key] = value
    return attributes


def resource_attributes(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The resource attributes: the defaults, then ``OTEL_RESOURCE_ATTRIBUTES``, then ``OTEL_SERVICE_NAME``."""
    env = os.environ if environ is None else environ
    attributes = {"service.name": DEFAULT_SERVICE_NAME, "service.version": __version__}
    text = env.get(RESOURCE_ATTRIBUTES_ENV, "")
    if text.strip():
        try:
            attributes.update(parse_resource_attributes(text))
        except ResourceAttributesError as exc:
            log.warning("%s; the variable is ignored", exc)
    service_name = env.get(SERVICE_NAME_ENV, "").strip()
    if service_name:
        attributes["service.name"] = service_name
    return attributes
