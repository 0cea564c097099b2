"""llmc postprocessing (Triton Python backend): output ids -> text with per-request incremental state.

Streamed chunks of one request share an ``IncrementalDetokenizer`` keyed by the request id (send an id
with streaming requests), so deltas keep their spaces and never split a multi-byte character; the state
is dropped on the request's last chunk. Non-streamed outputs are decoded in one go. Logic:
``llmc.serve.tokenization.StreamDetokenizers``; ``triton_python_backend_utils`` is imported lazily.
"""


import numpy as np

from llmc.serve.tokenization import StreamDetokenizers, TokenizerSettings
from llmc.serve.triton_model import input_arrays, model_parameters


def postprocess(detok, key, tokens, lengths, prompt_ids=None, max_tokens=None, stream=False):
    """tokens [B, beams, L] int32, lengths [B, beams] -> texts [B, beams] (beam 0 keyed by ``key``)."""
    texts = []
    for b in range(tokens.shape[0]):
        row = []
        for beam in range(tokens.shape[1]):
            ids = [int(t) for t in tokens[b, beam, : int(lengths[b, beam])]]
            prompt = [] if prompt_ids is None else [int(t) for t in prompt_ids[b]]
            if stream and key:
                row.append(detok.decode_delta(f"{key}/{b}/{beam}", ids, prompt,
                                              None if max_tokens is None else int(max_tokens[b])))
            else:
                row.append(detok.decode_all(ids, prompt))
        texts.append(row)
    return texts


class TritonPythonModel:
    def initialize(self, args):
        settings = TokenizerSettings.from_parameters(model_parameters(args))
        self.detok = StreamDetokenizers(settings.load_tokenizer(), settings)

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        responses = []
        for request in requests:
            try:
                a = input_arrays(pb_utils, request, ("TOKENS_BATCH", "SEQUENCE_LENGTH", "PROMPT_IDS", "STREAM",
                                                     "REQUEST_OUTPUT_LEN"))
                stream, max_tokens = a["STREAM"], a["REQUEST_OUTPUT_LEN"]
                texts = postprocess(self.detok, request.request_id(), a["TOKENS_BATCH"], a["SEQUENCE_LENGTH"],
                                    a["PROMPT_IDS"],
                                    None if max_tokens is None else max_tokens.reshape(-1),
                                    bool(stream is not None and stream.reshape(-1)[0]))
                out = np.array([[t.encode("utf-8") for t in row] for row in texts], dtype=np.object_)
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", out)]))
            except Exception as exc:
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc))))
        return responses

    def finalize(self):
        self.detok = None
