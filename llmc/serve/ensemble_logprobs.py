"""The Triton TensorRT-LLM ensemble's optional log-probability outputs, built from llmc's per-token values.

A request with the ensemble input ``return_log_probs: true`` runs with ``SamplingParams.logprobs = 0`` (each
generated token's log-probability under the model, no alternatives); every front end (KServe HTTP generate,
``/infer``, gRPC, the ``llmc`` Triton model) feeds the request's events through one :class:`EnsembleLogprobs`
and puts what it holds into its responses in the shapes tensorrtllm_backend uses (docs/TENSORRT_LLM.md,
"Log-probabilities through the ensemble", names the upstream files and commits):

- ``output_log_probs``, FP32, shape ``[batch, beams, tokens]`` = ``[1, 1, n]``: one per generated token of the
  output; a token that ended the request as a stop id (end_id, an eos id, a stop token id) is not an output
  token and has none: TensorRT-LLM does not advance the sequence length for the end token, and its batch
  manager copies log-probabilities only for tokens that advanced it;
- ``cum_log_probs``, FP32, shape ``[batch, beams]`` = ``[1, 1]``: their sum. The decoder's running sum does take
  the end token's term, but with one beam the request's value is last set for the token before it, so what
  the backend returns leaves it out too;
- streaming: every response carries the values of *all* tokens generated so far, not only the new ones
  (TensorRT-LLM's executor slices output ids per chunk but returns the whole log-probability vectors), so the
  last response holds the whole request's;
- both are absent unless the request asked for them, so such responses stay exactly what they were before.

In the generate extension's JSON a tensor of one element is a number and any other a flat list (Triton's
``http_server.cc`` ``ExactMappingOutput``), so ``cum_log_probs`` is a number and ``output_log_probs`` a list,
or a number for a one-token output.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.request.outputs import StreamEvent, output_logprobs

CUM_LOG_PROBS, OUTPUT_LOG_PROBS = "cum_log_probs", "output_log_probs"


class EnsembleLogprobs:
    """One request's log-probabilities so far, in the ensemble's terms; a no-op unless ``enabled``.

    Call :meth:`add` with every event of the request, in order (also events no response is sent for), then read
    the values for a response with :meth:`tensors`, :meth:`json_fields` or :meth:`infer_outputs`.
    """

    __slots__ = ("enabled", "output", "cum")

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.output: list[float] = []  # one per output token
        self.cum = 0.0  # summed in float64, returned as float32 like the tensor TensorRT-LLM returns

    def add(self, event: StreamEvent) -> None:
        """Take the log-probabilities of ``event``'s tokens (a terminating stop id's is left out of both)."""
        if not self.enabled or not event.logprobs:
            return
        values = [lp.logprob for lp in output_logprobs(event)]
        self.output.extend(values)
        self.cum += sum(values)

    def tensors(self) -> list[tuple[str, np.ndarray]]:
        """``[(name, float32 array)]`` of the two outputs with their batch and beam dims; empty when disabled."""
        if not self.enabled:
            return []
        return [(CUM_LOG_PROBS, np.array([[self.cum]], dtype=np.float32)),
                (OUTPUT_LOG_PROBS, np.array(self.output, dtype=np.float32).reshape(1, 1, len(self.output)))]

    def json_fields(self) -> dict[str, Any]:
        """The generate extension's keys: one element -> a number, otherwise a flat list; ``{}`` when disabled."""
        fields: dict[str, Any] = {}
        for name, array in self.tensors():
            values = array.reshape(-1).tolist()  # float32 -> Python floats (exact widening)
            fields[name] = values[0] if len(values) == 1 else values
        return fields

    def infer_outputs(self) -> list[dict[str, Any]]:
        """KServe v2 ``/infer`` JSON output objects (FP32, shape with batch and beam dims); empty when disabled."""
        return [{"name": name, "datatype": "FP32", "shape": list(array.shape), "data": array.reshape(-1).tolist()}
                for name, array in self.tensors()]
