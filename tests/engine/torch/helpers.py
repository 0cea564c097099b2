"""Test helpers for the portable engine: write the IR of a HF folder, make a build folder, drive paged steps."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch

from llmc.checkpoint import names
from llmc.checkpoint.config import trtllm_config_from_hf
from llmc.checkpoint.convert import hf_to_trtllm, shard
from llmc.checkpoint.int4 import quantize_rtn
from llmc.checkpoint.io import write_checkpoint
from llmc.engine.base import compile_engine
from llmc.engine.torch import cpu_ext
from llmc.engine.torch.attention import build_attention_metadata
from llmc.engine.torch.kv_alloc import allocate_kv_cache
from llmc.engine.torch.model import LlamaForCausalLM
from llmc.engine.types import ScheduledSequence, SchedulerOutput
from llmc.manifest import Manifest, write_manifest
from llmc.recipe import recipe_from_dict, recipe_to_dict
from llmc.request.params import SamplingParams
from llmc.source.load import load_state_dict

GREEDY = SamplingParams(temperature=0.0)


def write_ir(
    hf_dir: Path, out_dir: Path, dtype: str = "float32", tp_size: int = 1, quantized: dict | None = None,
    group_size: int | None = None,
) -> Path:
    """Convert a HF folder to the checkpoint IR with llmc.checkpoint (optionally W4A16 from ``quantized``)."""
    hf_config = json.loads((Path(hf_dir) / "config.json").read_text())
    quant = {"quant_algo": "W4A16_AWQ", "group_size": group_size} if quantized else None
    config = trtllm_config_from_hf(hf_config, dtype, tp_size=tp_size, quantization=quant)
    weights = hf_to_trtllm(load_state_dict(Path(hf_dir)), config, quantized)
    write_checkpoint(out_dir, config, [shard(weights, config, r) for r in range(tp_size)])
    return Path(out_dir)


def rtn_quantize_hf(hf_dir: Path, group_size: int, seed: int = 0) -> tuple[dict, dict[str, torch.Tensor]]:
    """RTN int4 of every HF decoder linear with a random AWQ pre-quant scale shared per input.

    Returns (``quantized`` for hf_to_trtllm, expected effective weight per HF module computed here as
    ``q * scale * prequant`` from the unpacked int4 values).
    """
    gen = torch.Generator().manual_seed(seed)
    state = load_state_dict(Path(hf_dir))
    n_layers = json.loads((Path(hf_dir) / "config.json").read_text())["num_hidden_layers"]
    quantized, effective = {}, {}
    for layer in range(n_layers):
        prequants: dict[str, torch.Tensor] = {}
        for spec in names.LINEARS:
            in_features = state[names.hf_layer(layer, spec.hf[0])].shape[1]
            source = "mlp.fc" if spec.trt == "mlp.gate" else spec.trt  # fc and gate read the same input
            if source not in prequants:
                prequants[source] = torch.rand(in_features, generator=gen) + 0.5
            prequant = prequants[source]  # shared by modules reading one input
            for module in spec.hf:
                w = state[names.hf_layer(layer, module)].float()
                q, scales = quantize_rtn(w / prequant[None, :], group_size)
                key = names.hf_module(layer, module)
                quantized[key] = (q, scales, prequant)
                effective[key] = q.float() * scales.float().repeat_interleave(group_size, dim=1) * prequant
    return quantized, effective


def make_build_dir(hf_dir: Path, build_dir: Path, dtype: str = "float32", tokens_per_block: int = 8) -> Path:
    """A minimal torch-backend build folder: checkpoint/, engine/ (compile_engine) and manifest.json."""
    write_ir(hf_dir, build_dir / "checkpoint", dtype=dtype)
    return build_dir_around(build_dir / "checkpoint", build_dir, tokens_per_block, source=hf_dir)


def build_dir_around(ir_dir: Path, build_dir: Path, tokens_per_block: int = 16, source: Path | None = None) -> Path:
    """A minimal torch-backend build folder around an existing IR (copied to ``build_dir/checkpoint`` unless it is
    there already): engine/ (compile_engine) and manifest.json, with the IR's dtype and quantization."""
    ir_dir, build_dir = Path(ir_dir), Path(build_dir)
    if ir_dir != build_dir / "checkpoint":
        shutil.copytree(ir_dir, build_dir / "checkpoint")
    config = json.loads((build_dir / "checkpoint" / "config.json").read_text())
    dtype, quant = config["dtype"], config.get("quantization") or {}
    quantization = ({"method": "rtn", "group_size": quant["group_size"]} if quant.get("quant_algo")
                    else {"method": "none"})
    recipe = recipe_from_dict(
        {
            "name": "tiny",
            "model": {"source": str(source or ir_dir), "dtype": dtype},
            "quantization": quantization,
            "kv_cache": {"tokens_per_block": tokens_per_block, "cpu_budget_mb": 4},
            "backend": "torch",
        },
        check_inputs=False,
    )
    compile_engine(recipe, build_dir / "checkpoint", build_dir / "engine")
    manifest = Manifest(
        name="tiny", recipe=recipe_to_dict(recipe), recipe_sha256="0" * 64, backend="torch", dtype=dtype,
        quantization=quantization, eos_token_ids=(2,), special_token_ids=(0, 1, 2),
        source={"kind": "hf", "origin": str(source or ir_dir), "sha256": "0" * 64}, model={}, tools={}, timings={},
    )
    write_manifest(build_dir, manifest)
    return build_dir


class PagedSession:
    """A stand-in for the scheduler: hands out KV blocks in a scrambled order and runs packed steps.

    ``step({request_id: new_token_ids})`` runs one packed forward and returns each sequence's logits at every
    new position (``[n_new, V]``), so tests can compare them with a full-sequence reference. ``forward(ids, meta)
    -> hidden`` (set after construction) replaces the model's own forward, e.g. by CUDA graphs in pieces.
    """

    def __init__(self, model: LlamaForCausalLM, block_size: int = 4, num_blocks: int = 64, seed: int = 0):
        weight = model.transformer.ln_f.weight
        self.model, self.block_size = model, block_size
        self.kv = allocate_kv_cache(model.config, num_blocks, block_size, weight.dtype, weight.device)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.forward = None

    def step(self, work: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        seqs = []
        for rid, tokens in work.items():
            blocks, done = self.blocks.setdefault(rid, []), self.computed.get(rid, 0)
            while len(blocks) * self.block_size < done + len(tokens):
                blocks.append(self.free.pop())
            seqs.append(ScheduledSequence(rid, tuple(tokens), done, tuple(blocks), True, GREEDY))
            self.computed[rid] = done + len(tokens)
        device = self.model.transformer.ln_f.weight.device
        meta = build_attention_metadata(seqs, self.block_size, device)
        ids = torch.tensor([t for s in seqs for t in s.token_ids], device=device)
        with torch.inference_mode():
            run = self.forward or (lambda ids, meta: self.model(ids, meta.positions, meta, self.kv))
            hidden = run(ids, meta)
            logits = self.model.compute_logits(hidden)
        return {s.request_id: logits[a:a + len(s.token_ids)] for s, a in zip(seqs, meta.query_starts)}


class MiniScheduler:
    """Just enough scheduling for the test: per-step chunk budget, blocks from a free list, greedy decode."""

    def __init__(self, block_size: int, num_blocks: int, chunk: int, params: SamplingParams = GREEDY):
        self.block_size, self.chunk, self.params = block_size, chunk, params
        self.free = list(range(num_blocks - 1, -1, -1))
        self.reqs: dict[str, dict] = {}

    def add(self, rid: str, prompt: list[int], max_new: int) -> None:
        self.reqs[rid] = {"prompt": prompt, "out": [], "done": 0, "blocks": [], "max_new": max_new}

    def schedule(self, step: int) -> SchedulerOutput:
        seqs = []
        for rid, r in self.reqs.items():
            if len(r["out"]) >= r["max_new"]:
                continue
            tokens = (r["prompt"] + r["out"])[r["done"] : r["done"] + self.chunk]
            while len(r["blocks"]) * self.block_size < r["done"] + len(tokens):
                r["blocks"].append(self.free.pop())
            is_last = r["done"] + len(tokens) == len(r["prompt"]) + len(r["out"])
            seqs.append(ScheduledSequence(rid, tuple(tokens), r["done"], tuple(r["blocks"]), is_last, self.params,
                                          tuple(r["prompt"]), tuple(r["out"])))
            r["done"] += len(tokens)
        return SchedulerOutput(step=step, sequences=tuple(seqs))

    def update(self, sampled: dict[str, int]) -> None:
        for rid, token in sampled.items():
            self.reqs[rid]["out"].append(token)


def graph_and_eager_tokens(build: Path) -> dict[bool, dict[str, list[int]]]:
    """Greedy tokens of three requests (prompt chunks of 64, then decodes) through the CUDA runner of ``build`` with
    CUDA graphs (``True``) and eagerly (``False``), one runner at a time."""
    from llmc.engine.torch.runner import TorchModelRunner

    outs = {}
    for graphs in (True, False):
        runner = TorchModelRunner(build, device="cuda", num_blocks=64, cuda_graphs=graphs)
        assert (runner.graphs is not None) == graphs
        sched = MiniScheduler(runner.block_size, runner.num_blocks, chunk=64)
        for i in range(3):
            sched.add(f"r{i}", list(range(500 + 7 * i, 540 + 11 * i)), max_new=12)
        for step in range(20):
            sched.update(runner.execute(sched.schedule(step)).sampled_token_ids)
        outs[graphs] = {rid: r["out"] for rid, r in sched.reqs.items()}
        del runner
        torch.cuda.empty_cache()
    return outs


def forget_cpu_kernels() -> None:
    """Make :func:`cpu_ext.load` answer afresh, as in a new process (after changing ``LLMC_CPU_KERNELS`` or the
    build); a background build must have finished."""
    cpu_ext._module, cpu_ext._loaded, cpu_ext._background = None, False, None


def random_decode_batch(device, dtype, block_size=16, num_blocks=64, nkv=4, group=3, hd=64,
                        lengths=(1, 16, 17, 100, 333)):
    """A decode step's queries, K/V caches and attention metadata over scattered blocks (contexts of 1-333 tokens)
    for the paged decode attention tests."""
    torch.manual_seed(0)
    k_cache = torch.randn(num_blocks, block_size, nkv, hd, device=device).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, nkv, hd, device=device).to(dtype)
    order = torch.randperm(num_blocks - 1).tolist()  # scattered, non-contiguous block tables
    seqs, used = [], 0
    for i, length in enumerate(lengths):
        n = -(-length // block_size)
        blocks = tuple(b + 1 for b in order[used:used + n])
        used += n
        seqs.append(ScheduledSequence(f"r{i}", (7,), length - 1, blocks, True, GREEDY,
                                      prompt_token_ids=tuple(range(length - 1))))
    meta = build_attention_metadata(seqs, block_size, device)
    q = torch.randn(len(seqs), nkv * group, hd, device=device).to(dtype)
    return q, k_cache, v_cache, meta


def w4a16_ir(folder: Path, prequant: bool = True, quantized: bool = True) -> Path:
    """An IR folder holding one W4A16 layer of Qwen2.5-7B's per-rank shapes (empty tensors: only headers are read)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    shapes = {names.QKV.trt: (4608, 3584), names.DENSE.trt: (3584, 3584), names.FC.trt: (18944, 3584),
              names.GATE.trt: (18944, 3584), names.PROJ.trt: (3584, 18944)}
    tensors = {}
    for module, (n, k) in shapes.items():
        tensors[names.trt_layer(0, module)] = (torch.zeros(n // 2, k, dtype=torch.int8) if quantized
                                               else torch.zeros(n, k, dtype=torch.bfloat16))
        if prequant and quantized:
            tensors[names.trt_layer(0, module, names.PREQUANT_SCALING_FACTOR)] = torch.ones(1, k, dtype=torch.bfloat16)
    save_file(tensors, str(folder / "rank0.safetensors"))
    quant = {"quant_algo": "W4A16_AWQ", "group_size": 128} if quantized else {}
    (folder / "config.json").write_text(json.dumps({"quantization": quant}))
    return folder
