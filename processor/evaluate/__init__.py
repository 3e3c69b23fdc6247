"""Rule evaluation: the CEL expression language, the rule-file format and the streaming engine."""
