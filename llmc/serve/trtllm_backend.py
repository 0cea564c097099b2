"""What Triton's ``tensorrtllm`` C++ backend (TensorRT-LLM 1.0 - 1.2) reads from a model config, and the check
of a generated ``tensorrt_llm`` model against it.

Facts from the backend's source, NVIDIA/TensorRT-LLM ``triton_backend/inflight_batcher_llm/src/`` (docs/
TENSORRT_LLM.md names the commits read):

- ``ModelState::GetParameter`` throws when a parameter is absent. Most reads are wrapped in try/catch (default
  used), but four are not, so a config without them fails to load: ``gpt_model_type``
  (``getBatchingTypeFromParams``) and ``tokenizer_dir``, ``xgrammar_tokenizer_info_path``,
  ``guided_decoding_backend`` (``getGuidedDecodingConfigFromParams``, called from
  ``getExecutorConfigFromParams``). An empty string means "unset" for the last three.
- Request inputs are read by the names in ``InputFieldsNames`` (utils.h) plus ``streaming`` and ``stop``;
  the backend silently ignores an input it does not read, so a misnamed one (``random_seed`` and
  ``min_length``, renamed to ``seed`` and ``min_tokens`` in 2025) is a request option that does nothing.
"""

from __future__ import annotations

from typing import Any

# Parameters read without a try/catch (model_instance_state.cc).
REQUIRED_PARAMETERS = ("gpt_model_type", "tokenizer_dir", "xgrammar_tokenizer_info_path", "guided_decoding_backend")

# Every request input name the backend reads (utils.h InputFieldsNames, kStopInputTensorName,
# kStreamingInputTensorName).
INPUT_NAMES = frozenset({
    "input_ids", "encoder_input_features", "encoder_output_lengths", "input_lengths", "decoder_input_ids",
    "request_output_len", "no_repeat_ngram_size", "num_return_sequences", "end_id", "pad_id", "bad_words_list",
    "stop_words_list", "embedding_bias", "context_phase_params", "cross_attention_mask", "skip_cross_attn_blocks",
    "multimodal_embedding", "return_log_probs", "return_generation_logits", "return_context_logits",
    "exclude_input_in_output", "return_perf_metrics", "return_kv_cache_reuse_stats", "beam_width", "runtime_top_k",
    "runtime_top_p", "runtime_top_k_min", "runtime_top_p_decay", "runtime_top_p_reset_ids", "temperature",
    "len_penalty", "early_stopping", "repetition_penalty", "min_tokens", "beam_search_diversity_rate",
    "presence_penalty", "frequency_penalty", "seed", "prompt_embedding_table", "prompt_table_extra_ids",
    "mrope_rotary_cos_sin", "mrope_position_deltas", "lora_task_id", "lora_weights", "lora_config",
    "draft_input_ids", "draft_logits", "draft_acceptance_threshold", "retention_token_range_starts",
    "retention_token_range_ends", "retention_token_range_priorities", "retention_token_range_durations_ms",
    "retention_decode_priority", "retention_decode_duration_ms", "guided_decoding_guide_type",
    "guided_decoding_guide", "lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size",
    "stop", "streaming",
})


def check_trtllm_model(config: Any) -> list[str]:
    """Problems of a parsed ``tensorrt_llm`` ``ModelConfig`` (tritonclient's model_config_pb2) that would make
    the backend refuse to load it or ignore a request option; empty when sound."""
    problems = [f"parameter {name!r} is missing: the tensorrtllm backend reads it unconditionally and fails to "
                f"load the model without it (an empty string_value means unset)"
                for name in REQUIRED_PARAMETERS if name not in config.parameters]
    problems += [f"input {tensor.name!r} is not read by the tensorrtllm backend, so a request setting it would "
                 f"be silently ignored" for tensor in config.input if tensor.name not in INPUT_NAMES]
    return problems
