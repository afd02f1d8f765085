"""This worker process's place in vLLM's parallel groups: its TP, PP and DCP
ranks (0 where that parallelism is off), and how errors name the worker."""
from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from .metadata import rank_where

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def current_tp_rank(vllm_config: "VllmConfig") -> int:
    """This process's tensor parallel rank (0 without TP)."""
    if vllm_config.parallel_config.tensor_parallel_size <= 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def worker_where(vllm_config: "VllmConfig") -> str:
    """``node HOST, TP rank r, PP rank p`` of this worker process."""
    return rank_where(socket.gethostname(), current_tp_rank(vllm_config), current_pp_rank(vllm_config))


def current_pp_rank(vllm_config: "VllmConfig") -> int:
    """This process's pipeline parallel rank (0 without PP)."""
    if getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) <= 1:
        return 0
    from vllm.distributed.parallel_state import get_pp_group

    return get_pp_group().rank_in_group


def current_dcp_rank(vllm_config: "VllmConfig") -> int:
    """This process's rank in its DCP group (0 without DCP)."""
    if vllm_config.parallel_config.decode_context_parallel_size <= 1:
        return 0
    from vllm.distributed.parallel_state import get_dcp_group

    return get_dcp_group().rank_in_group
