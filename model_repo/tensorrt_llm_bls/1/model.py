"""llmc BLS model (decoupled Triton Python backend): one model doing tokenize -> tensorrt_llm -> detokenize.

It calls the ``tensorrt_llm`` model through BLS (streaming), owns one ``IncrementalDetokenizer`` per
request for exactly the request's lifetime, and sends one response per text delta, then the final flag. With
``return_log_probs`` the backend's ``cum_log_probs`` / ``output_log_probs`` (all tokens so far in each of its
responses) go out with every text response and with the final one, as the ensemble returns them.
The guided-decoding inputs go to ``tensorrt_llm`` unchanged (as tensorrtllm_backend's BLS forwards them), after
a check: the C++ backend silently decodes without a guide whose type it does not know.
Logic from ``llmc.serve.tokenization``; ``triton_python_backend_utils`` is imported lazily.
"""

import threading

import numpy as np

from llmc.serve.protocol import guided_format
from llmc.serve.tokenization import RequestTokenizer, StreamDetokenizers, TokenizerSettings
from llmc.serve.triton_model import input_arrays, model_parameters

# ensemble input -> tensorrt_llm input for the sampling tensors passed straight through
PASSTHROUGH = {"max_tokens": "request_output_len", "temperature": "temperature", "top_k": "runtime_top_k",
               "top_p": "runtime_top_p", "repetition_penalty": "repetition_penalty",
               "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
               "min_length": "min_tokens", "random_seed": "seed", "stream": "streaming",
               "return_log_probs": "return_log_probs", "guided_decoding_guide_type": "guided_decoding_guide_type",
               "guided_decoding_guide": "guided_decoding_guide"}
LOGPROB_OUTPUTS = ("cum_log_probs", "output_log_probs")


def check_guide(arrays):
    """RequestError (naming the input) for a guide the backend would drop or fail on: a guide without a type, a
    type other than json / json_schema / regex / ebnf_grammar, a type without its guide, a schema that is not
    JSON (:func:`llmc.serve.protocol.guided_format`). The texts go on unchanged."""
    text = lambda a: None if a is None else a.reshape(-1)[0].decode("utf-8")  # noqa: E731
    guided_format(text(arrays.get("guided_decoding_guide_type")), text(arrays.get("guided_decoding_guide")))


def trtllm_inputs(pre, arrays):
    """tensorrt_llm input arrays from the preprocessing outputs and the request's own arrays."""
    out = {"input_ids": pre["INPUT_ID"], "input_lengths": pre["REQUEST_INPUT_LEN"], "end_id": pre["OUT_END_ID"],
           "pad_id": pre["OUT_PAD_ID"], "stop_words_list": pre["STOP_WORDS_IDS"],
           "bad_words_list": pre["BAD_WORDS_IDS"],
           "exclude_input_in_output": np.array([[True]] * len(pre["INPUT_ID"]), dtype=np.bool_)}
    for name, target in PASSTHROUGH.items():
        if arrays.get(name) is not None:
            out[target] = arrays[name]
    return out


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        settings = TokenizerSettings.from_parameters(params)
        tokenizer = settings.load_tokenizer()
        self.pre = RequestTokenizer(tokenizer, settings)
        self.detok = StreamDetokenizers(tokenizer, settings)
        self.trtllm_name = params.get("tensorrt_llm_model_name", "tensorrt_llm")

    def execute(self, requests):
        for request in requests:  # decoupled: each request answers through its own sender thread
            threading.Thread(target=self._serve, args=(request,), daemon=True).start()
        return None

    def _serve(self, request):
        import triton_python_backend_utils as pb_utils

        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            arrays = input_arrays(pb_utils, request,
                                  ("text_input", "stop_words", "bad_words", "end_id", "pad_id", *PASSTHROUGH))
            check_guide(arrays)
            words = lambda a: None if a is None else [[x.decode() for x in row.reshape(-1)] for row in a]
            ints = lambda a: None if a is None else [int(x) for x in a.reshape(-1)]
            pre = self.pre.preprocess([arrays["text_input"].reshape(-1)[0].decode()], words(arrays["stop_words"]),
                                      words(arrays["bad_words"]), ints(arrays["end_id"]), ints(arrays["pad_id"]))
            inputs = [pb_utils.Tensor(k, np.ascontiguousarray(v)) for k, v in trtllm_inputs(pre, arrays).items()]
            wants_logprobs = arrays["return_log_probs"] is not None and bool(arrays["return_log_probs"].any())
            outputs = ["output_ids", "sequence_length", *(LOGPROB_OUTPUTS if wants_logprobs else ())]
            infer = pb_utils.InferenceRequest(model_name=self.trtllm_name, inputs=inputs,
                                              requested_output_names=outputs)
            key, prompt = f"bls-{id(request)}", pre["INPUT_ID"][0].tolist()
            logprobs = {}  # the backend's latest log-probability arrays (all tokens so far)
            for response in infer.exec(decoupled=True):
                if response.has_error():
                    raise RuntimeError(response.error().message())
                ids_t = pb_utils.get_output_tensor_by_name(response, "output_ids")
                if ids_t is None:  # the backend's empty final response
                    continue
                for name in LOGPROB_OUTPUTS if wants_logprobs else ():
                    tensor = pb_utils.get_output_tensor_by_name(response, name)
                    if tensor is not None:
                        logprobs[name] = tensor.as_numpy()
                lengths = pb_utils.get_output_tensor_by_name(response, "sequence_length").as_numpy()
                ids = [int(t) for t in ids_t.as_numpy()[0, 0, : int(lengths[0, 0])]]
                text = self.detok.decode_delta(key, ids, prompt)
                extra = [pb_utils.Tensor(name, array) for name, array in logprobs.items()]
                if text:
                    out = pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_))
                    sender.send(pb_utils.InferenceResponse(output_tensors=[out, *extra]))
            tail = self.detok.decode_delta(key, [], prompt, final=True)
            out = [pb_utils.Tensor("text_output", np.array([[tail.encode("utf-8")]], dtype=np.object_))] if tail else []
            out += [pb_utils.Tensor(name, array) for name, array in logprobs.items()]
            sender.send(pb_utils.InferenceResponse(output_tensors=out) if out else None, flags=final)
        except Exception as exc:
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc))),
                        flags=final)

    def finalize(self):
        self.detok = None
