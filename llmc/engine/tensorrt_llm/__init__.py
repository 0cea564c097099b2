"""The ``tensorrt_llm`` engine backend (TensorRT-LLM 1.0 - 1.2, the engine workflow).

Modules: ``versions`` (guarded lazy import), ``checks`` (recipe checks), ``config`` (recipe ->
BuildConfig/PluginConfig dicts, trtllm-build command line), ``build`` (engines per rank),
``manifest`` (engine versions), ``stop_words`` / ``sampling`` / ``runner`` (ModelRunnerCpp adapter).
The GPU-box comparison with the torch engine is scripts/acceptance_trtllm.py. Importing this package never
imports ``tensorrt_llm``; see docs/TENSORRT_LLM.md.
"""
