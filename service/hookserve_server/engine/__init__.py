"""The engine: sessions, admission, preparation, batch queues and device workers.

torch only, never grpc: the servicer adapts protobuf to these objects.
"""

from .config import EngineConfig
from .core import Engine
from .session import Session

__all__ = ["Engine", "EngineConfig", "Session"]
