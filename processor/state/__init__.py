"""What the engine remembers: the StateStore interface, the session state it stores, and the stores."""

from processor.state.base import EngineStateLike, StateStore, TimerEntry
from processor.state.memory import MemoryStore
from processor.state.session import RuleSchema, SessionState

__all__ = ["EngineStateLike", "MemoryStore", "RuleSchema", "SessionState", "StateStore", "TimerEntry"]
