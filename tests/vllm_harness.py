"""A real vLLM Scheduler and a worker-side connector over real CPU caches.

Scheduler: ``vllm.v1.core.sched.scheduler.Scheduler`` with the connector from
``kv_transfer_config`` (so it goes through vLLM's factory).  Caches: the KV
cache config vLLM computes for the given groups (``get_kv_cache_config_from_groups``)
and the per-layer views vLLM builds (``create_kv_cache_views``) over one
poisoned buffer.  A "step" runs ``schedule()``, hands the metadata to the
worker connector as the model runner does, and feeds back one sampled token
per scheduled request.
"""
from __future__ import annotations

import math
import json
import os
from dataclasses import dataclass, field

import torch
from oracle import poisoned_buffer
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, get_request_block_hasher, init_none_hash

try:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
except ImportError:  # vLLM 0.33 moved it
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheGroupSpec, create_kv_cache_views
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}


def runner_output(req_ids, **kw) -> ModelRunnerOutput:
    """One sampled token (7) per request, as the model runner reports it:
    vLLM 0.32/0.33's output also maps each request to its row
    (``req_id_to_index``), vLLM 0.34's has no such field (the rows are
    ``req_ids``' order)."""
    import dataclasses

    req_ids = list(req_ids)
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        kw["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[7] for _ in req_ids], **kw)


def model_dir(root) -> str:
    path = os.path.join(str(root), "tiny-llama-config")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(LLAMA, f)
    return path


def vllm_config(model_path, *, extra=None, block_size=16, prefix_caching=True, connector="KVFillConnector",
                module_path="kvfill.connector", cache_dtype="auto", max_model_len=2048, num_blocks=None,
                disable_hybrid=False, mamba_cache_mode="none") -> VllmConfig:
    kt = KVTransferConfig(
        kv_connector=connector,
        kv_role="kv_both",
        kv_connector_extra_config=dict(extra or {}),
        kv_connector_module_path=module_path,
    )
    from vllm.config import DeviceConfig

    return VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        model_config=ModelConfig(model=model_path, skip_tokenizer_init=True, max_model_len=max_model_len,
                                 dtype="bfloat16"),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching,
                                 cache_dtype=cache_dtype, num_gpu_blocks_override=num_blocks,
                                 mamba_cache_mode=mamba_cache_mode),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_model_len,
                                         max_model_len=max_model_len, is_encoder_decoder=False,
                                         # unset = vLLM decides (0.33 refuses an explicit "enable"
                                         # where it is unsupported)
                                         **({"disable_hybrid_kv_cache_manager": True} if disable_hybrid else {})),
        parallel_config=ParallelConfig(),
        kv_transfer_config=kt,
    )


@dataclass
class Harness:
    config: VllmConfig
    kv_cache_config: object
    scheduler: Scheduler
    worker: object
    raw: torch.Tensor
    views: dict
    specs: dict  # layer name -> spec
    layout: str = "LBNHC"
    poison: torch.Tensor = field(init=False)
    step_no: int = 0
    hasher: object = None

    def __post_init__(self):
        self.poison = self.raw.clone()
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(self.scheduler.block_size, hash_fn)

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 4, kv_transfer_params: dict | None = None):
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
        req = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra), None,
                      block_hasher=self.hasher)
        self.scheduler.add_request(req)
        return req

    def step(self):
        """schedule -> worker fill -> one sampled token per scheduled request."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        self.worker.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        self.scheduler.update_from_output(out, runner_output(req_ids))
        self.step_no += 1
        return out, meta

    def block_table(self, req_id: str) -> tuple[list[int], ...]:
        return self.scheduler.kv_cache_manager.get_block_ids(req_id)

    def views_over(self, buffer: torch.Tensor) -> dict:
        """The same per-layer views over another buffer (an expected copy)."""
        return _views(buffer, self.kv_cache_config, self.specs, self.layout)


def make_harness(tmp_path, groups: list[tuple[list[str], object]], *, num_blocks=64, layout="LBNHC",
                 poison_seed=3, untransferred=(), **cfg_kw) -> Harness:
    """``untransferred``: indices of groups vLLM keeps out of KV transfer
    (``enable_kv_transfer`` False, as vLLM 0.34 marks HiSparse's tiers)."""
    config = vllm_config(model_dir(tmp_path), num_blocks=num_blocks, **cfg_kw)
    config.cache_config.kv_cache_layout = layout  # what the engine core's resolution records
    kv_groups = [KVCacheGroupSpec(names, spec) for names, spec in groups]
    for i in untransferred:
        kv_groups[i].enable_kv_transfer = False
    kv_cache_config = get_kv_cache_config_from_groups(config, kv_groups, available_memory=1 << 40)
    specs = {n: getattr(spec, "kv_cache_specs", {}).get(n, spec) for names, spec in groups for n in names}  # per layer
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks  # as the engine core records it
    size = max(t.size for t in kv_cache_config.kv_cache_tensors)
    raw = poisoned_buffer(size, poison_seed)
    views = _views(raw, kv_cache_config, specs, layout)
    # the engine core's scheduler config: a uniform-type group as one of its layers' specs (vLLM's own helper)
    scheduler = Scheduler(config, generate_scheduler_kv_cache_config([kv_cache_config]),
                          StructuredOutputManager(config),
                          block_size=math.lcm(*(s.block_size for _, s in groups)))
    worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)
    worker.register_kv_caches(views)
    return Harness(config, kv_cache_config, scheduler, worker, raw, views, specs, layout)


def _views(raw, kv_cache_config, specs, layout) -> dict:
    views = {}
    for t in kv_cache_config.kv_cache_tensors:
        spec = specs[t.layers[0]]
        for name, v in zip(t.layers, create_kv_cache_views(raw, spec, kv_cache_config.num_blocks,
                                                            KVCacheLayout[layout], t)):
            views[name] = v
    return views
