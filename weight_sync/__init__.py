"""weight_sync: after each training step, push the trainer's weights to every engine.

``WeightSender(WeightSyncSettings(...))`` speaks SGLang's weight-update HTTP API
(``/init_weights_update_group``, ``/update_weights_from_distributed``, ``/update_weights_from_disk``,
...), so the same code drives SGLang servers and the embedded engine; nccl on CUDA, gloo on CPU.
The sender runs SGLang's update sequence; how the bytes travel is one class per transport in
``weight_sync/transports/`` (``distributed``, ``tensor``, ``disk``).
Import the sender from ``weight_sync.sender`` (this package stays import-light: the engine imports
``sglang_protocol.buckets`` and ``sglang_protocol.process_group``).
"""
