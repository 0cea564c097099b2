"""llmc preprocessing (Triton Python backend): prompts -> token ids, stop/bad words -> id lists, end/pad ids.

The logic is ``llmc.serve.tokenization.RequestTokenizer`` (tested without Triton); this file only moves
tensors. ``triton_python_backend_utils`` is imported inside the methods, so the module imports anywhere.
"""


import numpy as np

from llmc.serve.tokenization import RequestTokenizer, TokenizerSettings
from llmc.serve.triton_model import input_arrays, model_parameters


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

        responses = []
        for request in requests:
            try:
                a = input_arrays(pb_utils, request, ("QUERY", "STOP_WORDS_DICT", "BAD_WORDS_DICT", "END_ID", "PAD_ID"))
                queries = [q[0] for q in strings(a["QUERY"])]
                out = self.logic.preprocess(queries, strings(a["STOP_WORDS_DICT"]), strings(a["BAD_WORDS_DICT"]),
                                            scalars(a["END_ID"]), scalars(a["PAD_ID"]))
                tensors = [pb_utils.Tensor(name, np.ascontiguousarray(value)) for name, value in out.items()]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as exc:  # one bad request must not fail the batch
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc))))
        return responses

    def finalize(self):
        self.logic = None
