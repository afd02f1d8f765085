"""Every kind of vLLM state layer (``MambaSpec``: Mamba-1, short conv and its
replicated PLE variant, linear attention, KDA with and without RecoverSSM,
gated delta-net, Mamba-2 with and without the ReplaySSM ring) cut over tensor
parallelism by kvfill (connector/states.py ``state_layout``, bank/state.py
``StateTensor``) exactly as vLLM shards it: shapes and dtypes come from vLLM's
own ``MambaStateShapeCalculator`` / ``MambaStateDtypeCalculator`` at TP 1, 2
and 4 in both conv layouts (``VLLM_SSM_CONV_STATE_LAYOUT`` SD and DS), and
each rank's bytes are checked against a reference cut written here from how
vLLM's layers load their weights (tests/test_bank_states.py holds the bank's
own state tests)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

pytest.importorskip("vllm")
# (no needs_vllm mark: the module itself is skipped where vLLM is missing, as tests/device_image.py expects)
from vllm import __version__ as vllm_version  # noqa: E402
from vllm.config.mamba import MambaBackendEnum  # noqa: E402
from vllm.model_executor.layers.mamba import mamba_utils  # noqa: E402
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator as D  # noqa: E402
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as S  # noqa: E402
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as E  # noqa: E402
from vllm.v1.kv_cache_interface import MambaSpec  # noqa: E402

from kvfill.bank.state import pack, unpack  # noqa: E402
from kvfill.connector.states import conv_dim_first, state_layout  # noqa: E402
from kvfill.record.assemble import merge_states  # noqa: E402

BF16, F16 = torch.bfloat16, torch.float16
TPS = [1, 2, 4]
SEQS = 2  # sequences per state tensor


@dataclass(frozen=True)
class Kind:
    """A state layer as a model builds it: vLLM's calculators at TP ``t``
    (``shapes(t)``), its dtypes, its kind, and how its weight loaders shard
    the conv state's channels: ``conv_parts`` sizes (TP 1) each split evenly
    over the ranks on its own; None: the layer has no conv state."""

    mamba_type: E
    shapes: Callable[[int], tuple]
    dtypes: tuple
    conv_parts: tuple[int, ...] | None
    replicated: bool = False

    def spec(self, t: int) -> MambaSpec:
        return MambaSpec(block_size=16, shapes=tuple(self.shapes(t)), dtypes=self.dtypes,
                         mamba_type=self.mamba_type, tp_replicated=self.replicated)


def _kda(t, recover=False):  # Kimi / Bailing-V3 / GLM-5-Next: 4 heads of 8, q = k = v = 32 channels, kernel 4
    base = S.kda_state_shape(t, 4, 8, conv_kernel_size=4)
    return S.append_kda_recoverssm_record(base, 4, 8, t, 2) if recover else base


def _mamba2(t, ring=False):  # 8 heads of 4 (x: 32), 4 groups of state 4 (B, C: 16 each), kernel 4
    base = S.mamba2_state_shape(t, 32, 4, 8, 4, 4, 4)
    return S.append_replayssm_ring(base, 4, t, 3, MambaBackendEnum.TRITON) if ring else base


KDA_DTYPES = D.kda_state_dtype(BF16, "auto")
M2_DTYPES = D.mamba2_state_dtype(BF16, "auto", "auto")
KINDS = {
    # MambaMixer: conv1d is one ColumnParallelLinear of I = 32 channels; A (ssm [I, N]) split on dim 0
    "mamba1": Kind(E.MAMBA1, lambda t: S.mamba1_state_shape(t, 32, 8, 4),
                   D.mamba1_state_dtype(BF16, "auto", "float32"), (32,)),
    # ShortConv (lfm2): conv is one ColumnParallelLinear of 32 channels; one speculative token
    "short_conv": Kind(E.SHORT_CONV, lambda t: S.short_conv_state_shape(t, 32, 3, num_spec=1),
                       D.short_conv_state_dtype(F16, "auto"), (32,)),
    # Qwen4-exp PLE: a short conv computed with t = 1 on every rank, tp_replicated
    "short_conv_ple": Kind(E.SHORT_CONV, lambda t: S.short_conv_state_shape(1, 24, 4),
                           D.short_conv_state_dtype(BF16, "auto"), (24,), replicated=True),
    # LinearAttention (bailing_moe_linear, MiniMax): rank r holds heads [r H/t, (r+1) H/t) (its tp_slope)
    "linear": Kind(E.LINEAR, lambda t: S.linear_attention_state_shape(8, t, 4),
                   D.linear_attention_state_dtype(BF16, "float32"), None),
    # KDA reports GDN_ATTN; fused conv1d loader: q, k, v (32 each) each sharded on its own
    "kda": Kind(E.GDN_ATTN, _kda, KDA_DTYPES, (32, 32, 32)),
    # vLLM 0.32's RecoverSSM appends its verify record to KDA's state (below, where vLLM has it)
    # Qwen3-Next GDN: 4 key heads of 4 (q, k: 16), 8 value heads of 8 (v: 64); recurrent [Vh, Vd, Kd]
    "gdn": Kind(E.GDN_ATTN, lambda t: S.gated_delta_net_state_shape(t, 4, 8, 4, 8, 4),
                D.gated_delta_net_state_dtype(BF16, "auto", "float32"), (16, 16, 64)),
    # MambaMixer2: x, B, C sharded each on its own (groups divide the ranks)
    "mamba2": Kind(E.MAMBA2, _mamba2, M2_DTYPES, (32, 16, 16)),
    "mamba2_replayssm": Kind(E.MAMBA2, lambda t: _mamba2(t, ring=True),
                             D.append_replayssm_ring(M2_DTYPES, BF16), (32, 16, 16)),
}

if hasattr(D, "append_kda_recoverssm_record"):  # vLLM 0.32; 0.34 keeps RecoverSSM's records outside the cache
    KINDS["kda_recoverssm"] = Kind(E.GDN_ATTN, lambda t: _kda(t, recover=True),
                                   D.append_kda_recoverssm_record(KDA_DTYPES, BF16), (32, 32, 32))
    NAMES = list(KINDS)
else:  # vLLM 0.34: RecoverSSM's verify records live outside the KV cache, KDA's state is the plain "kda" kind
    NAMES = list(KINDS) + [pytest.param("kda_recoverssm", marks=pytest.mark.skip(
        reason="vLLM %s has no MambaStateShapeCalculator/MambaStateDtypeCalculator.append_kda_recoverssm_record: "
               "RecoverSSM keeps its verify records outside the KV cache (KDARecoverSSMRecords); KDA's "
               "MambaSpec is the plain 'kda' kind" % vllm_version))]


@pytest.fixture(params=["SD", "DS"])
def conv_layout(request, monkeypatch):
    """vLLM's conv state layout, set as a user sets it (the env variable), so
    vLLM's calculators and kvfill's ``conv_dim_first`` both read it."""
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", request.param)
    mamba_utils.get_conv_state_layout.cache_clear()
    assert mamba_utils.is_conv_state_dim_first() == (request.param == "DS")
    yield request.param
    mamba_utils.get_conv_state_layout.cache_clear()


def _patterned(shape, dtype, first=0):
    """``[SEQS, *shape]`` whose every element has its own bit pattern (an
    integer count viewed as ``dtype``): a misplaced element shows."""
    ints = {2: torch.int16, 4: torch.int32}[torch.empty((), dtype=dtype).element_size()]
    n = SEQS * math.prod(shape)
    assert first + n < 2 ** 15
    return (torch.arange(n, dtype=ints) + first).view(dtype).reshape(SEQS, *shape)


def _full_states(kind):
    return [_patterned(s, d, 4000 * i) for i, (s, d) in enumerate(zip(kind.shapes(1), kind.dtypes))]


def _bytes(t):
    return t.contiguous().view(torch.uint8)


def _same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def _vllm_cut(kind, i, full, r, t, dim_first):
    """Rank r of t's part of state ``i`` (``full``: ``[SEQS, *TP-1 shape]``)
    as vLLM's weight loaders shard the layer: the conv state's channels part
    by part, each part's r-th t-th (``MergedColumnParallelLinear`` / fused
    conv1d loaders), its rank's pieces side by side; other states on their
    first dim (heads, or Mamba-1's channels), contiguous per rank."""
    if kind.replicated:
        return full
    if i == 0 and kind.conv_parts is not None:
        ch = 1 if dim_first else 2
        assert full.shape[ch] == sum(kind.conv_parts)
        return torch.cat([p.chunk(t, dim=ch)[r] for p in full.split(kind.conv_parts, dim=ch)], dim=ch)
    return full.chunk(t, dim=1)[r]


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("name", NAMES)
def test_a_layout_recorded_at_any_tp_is_vllms_tp1_state(name, tp, conv_layout):
    """What a rank derives from its own spec at TP ``tp`` is the layout a
    TP 1 engine derives, naming vLLM's TP 1 shapes and dtypes."""
    kind = KINDS[name]
    assert conv_dim_first() == (conv_layout == "DS")
    layout = state_layout(kind.spec(tp), tp)
    assert layout == state_layout(kind.spec(1), 1)
    assert [st.shape for st in layout] == [tuple(s) for s in kind.shapes(1)]
    assert [st.dtype for st in layout] == list(kind.dtypes)
    assert all((st.dim is None) == kind.replicated for st in layout)


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("name", NAMES)
def test_each_rank_loads_exactly_the_bytes_vllm_shards_to_it(name, tp, conv_layout):
    kind = KINDS[name]
    dim_first = conv_layout == "DS"
    layout = state_layout(kind.spec(tp), tp)
    full = _full_states(kind)
    vllm_shapes = [tuple(s) for s in kind.shapes(tp)]
    for r in range(tp):
        for i, (st, x) in enumerate(zip(layout, full)):
            cut = st.take(x, r, tp)
            assert tuple(cut.shape[1:]) == vllm_shapes[i] == st.local_shape(r, tp), (r, i)
            assert _same_bytes(cut, _vllm_cut(kind, i, x, r, tp, dim_first)), (r, i)


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("name", NAMES)
def test_the_ranks_recorded_pages_merge_back_to_the_full_state(name, tp, conv_layout):
    """The recorder's path: each rank's state page as vLLM holds it, read with
    the layout's local shapes, merged over the ranks (``merge_states``)."""
    kind = KINDS[name]
    dim_first = conv_layout == "DS"
    layout = state_layout(kind.spec(tp), tp)
    full = _full_states(kind)
    parts = []
    for r in reversed(range(tp)):  # arrival order is not rank order
        page = pack([_vllm_cut(kind, i, x, r, tp, dim_first) for i, x in enumerate(full)])
        tensors = unpack(page, [st.local_shape(r, tp) for st in layout], [st.dtype for st in layout])
        parts.append((r, tp, layout, tensors, f"TP rank {r}"))
    merged, merged_layout = merge_states("l", parts, "test")
    assert merged_layout == layout
    assert len(merged) == len(full)
    for i, (m, x) in enumerate(zip(merged, full)):
        assert _same_bytes(m, x), i


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("name", NAMES)
def test_a_rank_counts_the_bytes_of_its_cut_which_fill_vllms_page(name, tp, conv_layout):
    kind = KINDS[name]
    layout = state_layout(kind.spec(tp), tp)
    full = _full_states(kind)
    page_bytes = kind.spec(tp).page_size_bytes  # unpadded: the states one after another
    for r in range(tp):
        cuts = [st.take(x, r, tp) for st, x in zip(layout, full)]
        for st, cut in zip(layout, cuts):
            assert st.local_nbytes(r, tp) == cut[0].numel() * cut.element_size() > 0
        assert sum(st.local_nbytes(r, tp) for st in layout) == page_bytes == pack(cuts).shape[1]
    whole = sum(st.nbytes for st in layout)
    assert whole == kind.spec(1).page_size_bytes
    assert whole == (page_bytes if kind.replicated else page_bytes * tp)


def test_mamba2_with_fewer_groups_than_ranks_replays_at_its_own_tp_and_no_other():
    """Falcon-H1-like Mamba-2 with one group: at TP 2 vLLM gives every rank
    its half of x and B, C whole (``extra_groups_for_head_shards``). A
    recording at TP 2 replays there byte for byte; its layout is not vLLM's
    TP 1 or TP 4 state, so a bank so recorded is refused there by its shapes
    (the limitation connector/states.py names)."""
    kind = Kind(E.MAMBA2, lambda t: S.mamba2_state_shape(t, 32, 1, 8, 4, 4, 4), M2_DTYPES, None)
    x_dim, g_dim = 32, 4  # x channels; B and C each one group of state 4
    g = torch.Generator(device="cpu").manual_seed(0)
    ssm = torch.randn(SEQS, 8, 4, 4, generator=g, device="cpu").to(BF16)
    conv = torch.randn(SEQS, 3, x_dim + 2 * g_dim, generator=g, device="cpu").to(BF16)
    x, b, c = conv.split([x_dim, g_dim, g_dim], dim=2)
    pages = [[torch.cat([x.chunk(2, dim=2)[r], b, c], dim=2), ssm.chunk(2, dim=1)[r]] for r in range(2)]
    assert [tuple(p.shape[1:]) for p in pages[0]] == [tuple(s) for s in kind.shapes(2)]
    layout = state_layout(kind.spec(2), 2, dim_first=False)
    merged, _ = merge_states("l", [(r, 2, layout, pages[r], f"TP rank {r}") for r in range(2)], "test")
    assert _same_bytes(merged[0][..., :x_dim], x) and _same_bytes(merged[1], ssm)
    for r in range(2):
        for st, m, want in zip(layout, merged, pages[r]):
            assert _same_bytes(st.take(m, r, 2), want), r
    assert layout[0].shape != tuple(kind.shapes(1)[0])
    assert layout[0].local_shape(0, 4) != tuple(kind.shapes(4)[0])
