"""Durable Check: tells whether long-lived agent sessions would survive a crash.

Data flows receive -> convert -> evaluate -> export; ``processor.pipeline`` wires the
stages, and both ``durable-check replay`` and ``durable-check serve`` drive it.
"""

from processor._version import __version__
from processor.errors import (
    ConfigError,
    DurableCheckError,
    EvaluationError,
    ExpressionError,
    InputError,
    Problem,
    ProblemsError,
    RuleFormatError,
    StateError,
)
from processor.records import Action, Malformed, Record, validate_record
from processor.violations import Violation, make_violation_id

__all__ = [
    "Action",
    "ConfigError",
    "DurableCheckError",
    "EvaluationError",
    "ExpressionError",
    "InputError",
    "Malformed",
    "Problem",
    "ProblemsError",
    "Record",
    "RuleFormatError",
    "StateError",
    "Violation",
    "__version__",
    "make_violation_id",
    "validate_record",
]
