"""Helpers for agent code that is checked by Durable Check (only ``opentelemetry-api`` is needed)."""

from durable_check import annotate
from durable_check.annotate import (
    action,
    approval_decision,
    awaiting_approval,
    checkpoint,
    set_action,
    set_idempotency_key,
    set_on_failure,
    set_plan,
    set_replayed,
    set_retry,
    set_session,
    waiting,
)

__all__ = [
    "action",
    "annotate",
    "approval_decision",
    "awaiting_approval",
    "checkpoint",
    "set_action",
    "set_idempotency_key",
    "set_on_failure",
    "set_plan",
    "set_replayed",
    "set_retry",
    "set_session",
    "waiting",
]
