"""Receive: where Actions come from (files offline, OTLP receivers when serving)."""
