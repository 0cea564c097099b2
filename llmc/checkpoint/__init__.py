"""The TensorRT-LLM checkpoint IR: the interface between llmc's build steps and its engine backends.

- ``names``: the one Hugging Face <-> TensorRT-LLM tensor-name map (and which linears are column/row-parallel).
- ``config``: ``trtllm_config_from_hf`` (config.json) and ``ModelShape`` (its frozen, validated view).
- ``convert``: ``hf_to_trtllm`` (unsharded tensors), ``shard`` / ``merge_shards`` (tensor parallelism),
  ``pad_for_groupwise``.
- ``io``: ``write_checkpoint`` / ``read_checkpoint``, ``expected_tensor_specs``.
- ``safetensors_header``: ``read_safetensors_header`` (no torch).
- ``int4``: W4A16_AWQ packing (``pack_int4`` / ``unpack_int4``), ``quantize_rtn``, ``dequantize_w4a16``.
"""
