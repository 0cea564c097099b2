"""llmc torch engine as a decoupled Triton Python-backend model.

One request -> a stream of responses (one per text delta; ``stream: false`` -> one response), then the
final flag. Tensors and their meaning are the TensorRT-LLM ensemble's (``llmc.serve.protocol``), parsed by
the same code as ``llmc serve``; with ``return_log_probs`` each text response, and the last one of the request,
also carries ``cum_log_probs`` / ``output_log_probs`` for all tokens so far (``llmc.serve.ensemble_logprobs``).
``triton_python_backend_utils`` is imported lazily.
"""


import numpy as np

from llmc.serve.ensemble_logprobs import EnsembleLogprobs
from llmc.serve.protocol import ENSEMBLE_INPUTS, parse_generate_fields
from llmc.serve.triton_model import input_arrays, model_parameters


def request_fields(arrays):
    """Ensemble fields from ``{name: numpy array [1, ...]}`` (absent inputs are None and skipped)."""
    fields = {}
    for name, array in arrays.items():
        if array is None:
            continue
        values = [x.decode("utf-8") if isinstance(x, bytes) else x.item() for x in array.reshape(-1)]
        fields[name] = values if name in ("stop_words", "bad_words") else values[0]
    return fields


class TritonPythonModel:
    def initialize(self, args):
        from llmc.runtime.api import Engine

        params = model_parameters(args)
        self.engine = Engine.from_dir(params["build_dir"], device=params.get("device", "auto"))
        self.engine.start()

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        for request in requests:
            sender = request.get_response_sender()
            final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            try:
                arrays = input_arrays(pb_utils, request, [spec.name for spec in ENSEMBLE_INPUTS])
                req = parse_generate_fields(request_fields(arrays), self.engine.default_params,
                                            self.engine.runner.vocab_size, allow_extras=False)
                self.engine.add_request(req.prompt, req.params, sink=self._sink(sender, req, pb_utils))
            except Exception as exc:
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc))),
                            flags=final)
        return None

    @staticmethod
    def _sink(sender, req, pb_utils):
        """The engine callback for one request (runs on the engine's step thread)."""
        held = [] if req.exclude_input_in_output else [req.prompt]
        logprobs = EnsembleLogprobs(req.return_log_probs)

        def text_response(text):
            out = pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_))
            extra = [pb_utils.Tensor(name, array) for name, array in logprobs.tensors()]
            return pb_utils.InferenceResponse(output_tensors=[out, *extra])

        def sink(event):
            held.append(event.text)
            logprobs.add(event)
            if event.finish_reason == "error":
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(event.error)),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            text = "".join(held)
            # The last response of a request that asked for log-probabilities goes out even without text.
            if (req.stream or event.finished) and (text or (event.finished and logprobs.enabled)):
                sender.send(text_response(text))
                held.clear()
            if event.finished:
                sender.send(None, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return sink

    def finalize(self):
        self.engine.shutdown()
