"""llmc preprocessing (Triton Python backend): prompts -> token ids, stop/bad words -> id lists, end/pad ids.

The logic is ``llmc.serve.tokenization.RequestTokenizer`` (tested without Triton); this file only moves
tensors. ``triton_python_backend_utils`` is imported inside the methods, so the module imports anywhere.
"""

import json

import numpy as np

from llmc.serve.tokenization import RequestTokenizer, TokenizerSettings


def model_parameters(args):
    """``{name: string_value}`` of the model's config.pbtxt parameters."""
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def strings(array):
    """A [B, n] BYTES array -> per-row lists of str (None -> empty rows)."""
    if array is None:
        return None
    return [[x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in row.reshape(-1)] for row in array]


def scalars(array):
    """A [B, 1] array -> per-row Python ints (None when the optional input is absent)."""
    return None if array is None else [int(x) for x in array.reshape(-1)]


class TritonPythonModel:
    def initialize(self, args):
        settings = TokenizerSettings.from_parameters(model_parameters(args))
        self.logic = RequestTokenizer(settings.load_tokenizer(), settings)

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        def get(request, name):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        responses = []
        for request in requests:
            try:
                queries = [q[0] for q in strings(get(request, "QUERY"))]
                out = self.logic.preprocess(queries, strings(get(request, "STOP_WORDS_DICT")),
                                            strings(get(request, "BAD_WORDS_DICT")),
                                            scalars(get(request, "END_ID")), scalars(get(request, "PAD_ID")))
                tensors = [pb_utils.Tensor(name, np.ascontiguousarray(value)) for name, value in out.items()]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as exc:  # one bad request must not fail the batch
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc))))
        return responses

    def finalize(self):
        self.logic = None
