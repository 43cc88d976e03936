"""The embedded engine: an inference server speaking SGLang's native HTTP API on top of
transformers, for machines where SGLang cannot run (CPU) and as the default engine.

    python -m embedded_engine --model-path DIR --host 127.0.0.1 --port P

From Python: ``launch_engine_process(EngineSettings(...)) -> (Popen, url)`` or, inside Ray,
``start_engine_actor(EngineSettings(...)) -> (actor, url)`` (``embedded_engine.actor``).
"""

from .launch import launch_engine_process, wait_healthy
from .settings import EngineSettings, parse_settings

__all__ = ["EngineSettings", "parse_settings", "launch_engine_process", "wait_healthy"]
