"""The data buffer: the one thing the rollout side and the trainer share.

``create_buffer(name, BufferSettings(...))`` starts the named Ray actor; ``get_buffer(name)``
finds it from any process. ``BufferCore`` is the same logic without Ray. Importing this package
does not import Ray.
"""

from buffer.core import BufferCore
from buffer.interfaces import BufferSettings, create_buffer, get_buffer
from buffer.sample import Sample, Status

__all__ = ["BufferCore", "BufferSettings", "Sample", "Status", "create_buffer", "get_buffer"]
