"""One request's life outside the model, shared by every engine backend and the runtime (device-free).

- ``params``: ``SamplingParams``, the one sampling type of the CLI, the Python API, the server and recipes.
- ``inputs``: prompt text / chat messages / token ids -> token ids, length checks.
- ``outputs``: ``RequestOutput`` (stop ids -> incremental detokenizer -> stop strings -> length limits),
  ``StreamEvent``, ``Completion``.
- ``stop``: stop ids and incremental stop strings (pure). ``detokenize``: ``IncrementalDetokenizer``.
- ``metrics``: ``RequestMetrics``, ``StepMetrics``, the JSONL metrics log, latency percentiles.
"""
