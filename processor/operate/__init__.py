"""The operator view: what waits now, recent violations, session timelines and the pipeline (docs/operate.md)."""
