"""Model sources: a recipe's ``model.source`` (HF folder | GGUF file) -> ``SourceModel``, the build's input.

- ``sources``: locating a source (paths, ``package:`` GGUF files), magic-byte checks, hashing,
  ``read_source_config`` (the model config without conversion).
- ``load``: ``resolve_source`` (HF folders validated in place, GGUF files converted once into a cache),
  ``load_state_dict``.
- ``eos``: ``reconcile_eos`` (one list of end ids from tokenizer, config, generation config and chat template).

Used by the builder, by ``llmc validate`` and by the bench's transformers baseline (the build's source model).
"""
