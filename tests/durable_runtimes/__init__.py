"""A billing agent built with real durable runtimes, crashed and recovered, for the corpus tests."""
