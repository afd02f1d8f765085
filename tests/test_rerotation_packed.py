"""DeepSeek's packed rows re-rotated past a recorded sequence's end
(``past_bank="rotate"``, kernels/rotary.py): the indexer K cache's fp8 keys
with their power-of-two scale (float32, or four UE8M0 bytes) and
``fp8_ds_mla`` rows' bf16 RoPE part.  The bank is written by the ports of
vLLM's writers (bench/dsa_writers.py) from keys rotated at their recorded
positions; the oracle turns each recorded key in float64 by the table's
rows.  Positions below the end keep the recorded bytes; past it the
indexer's key decodes to the oracle's within fp8's rounding under a scale
chosen by vLLM's writer's rule, and a ``fp8_ds_mla`` row's latent and scales
keep their bytes while its RoPE part is the oracle's within bf16's rounding;
both backends, both placements."""
import numpy as np
import pytest
import torch
from kvfill.bench.dsa_writers import indexer_row, pack_ds_mla
from test_packed_rows import D, ds_mla_group, entries, group, kernel_cache
from test_rerotation import rope_table

from kvfill.kernels import Bank, FillEngine
from kvfill.kernels.packed_rows import DS_MLA_ROW
from kvfill.kernels.rotary import Rotary

N_BANK, N_FILL = 40, 150  # recorded positions; filled positions (blocks [0, 2] of 128 tokens)
ROPE = 64
TABLE = rope_table(256, ROPE, mscale=1.2)


def turn(x: np.ndarray, t: int, p: int, neox: bool, table: np.ndarray) -> np.ndarray:
    """``x`` [ROPE] turned from position p to t by the table (float64), in NeoX or GPT-J pairs."""
    half = ROPE // 2
    ct, st, cp, sp = table[t, :half], table[t, half:], table[p, :half], table[p, half:]
    den = cp * cp + sp * sp
    c, s = (ct * cp + st * sp) / den, (st * cp - ct * sp) / den
    i = np.arange(half)
    a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
    out = x.copy()
    out[a], out[b] = x[a] * c - x[b] * s, x[b] * c + x[a] * s
    return out


def rotated_at(raw: torch.Tensor, neox: bool) -> torch.Tensor:
    """Raw keys ``[n, >= ROPE]`` with their first ROPE elements rotated to positions 0..n-1 (float64)."""
    x = raw.double().numpy().copy()
    table = TABLE.double().numpy()
    for p in range(len(x)):
        x[p, :ROPE] = turn(x[p, :ROPE], p, 0, neox, table)
    return torch.from_numpy(x)


def decode_indexer(rows: torch.Tensor, mx: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys float64 [n, D], scales [n]) of indexer rows."""
    scale_bytes = rows[:, D:D + 4]
    if mx:
        assert (scale_bytes == scale_bytes[:, :1]).all(), "an MX scale is four equal UE8M0 bytes"
        scale = torch.exp2(scale_bytes[:, 0].double() - 127)
    else:
        scale = scale_bytes.contiguous().view(torch.float32)[:, 0].double()
    return rows[:, :D].contiguous().view(torch.float8_e4m3fn).double() * scale[:, None], scale


def fill(bank_rows: torch.Tensor, name: str, make_group, width: int, rotary: Rotary, backend, **placement):
    cache = kernel_cache(width, seed=5)
    FillEngine(make_group(cache), bank=Bank({name: bank_rows}, sequence_lengths=[N_BANK]), backend=backend,
               past_bank="rotate", rotary={name: rotary}, **placement).fill({"g": entries([0, 2], N_FILL)})
    return FillEngine(make_group(cache), backend=backend).read({"g": entries([0, 2], N_FILL)})[name]


def mx_rows(rows: torch.Tensor) -> torch.Tensor:
    """Indexer rows with each float32 power-of-two scale stored as four UE8M0 bytes."""
    out = rows.clone()
    exponent = torch.log2(rows[:, D:].contiguous().view(torch.float32)[:, 0]).round().to(torch.int64) + 127
    out[:, D:] = exponent.to(torch.uint8)[:, None]
    return out


@pytest.mark.parametrize("placement", [{}, {"bank_placement": "host", "staging_bytes": 1}], ids=["device", "host"])
@pytest.mark.parametrize("mx", [False, True], ids=["float32-scale", "ue8m0-scale"])
def test_indexer_keys_past_the_end_are_dequantised_turned_and_requantised(mx, placement, backend):
    g = torch.Generator(device="cpu").manual_seed(3)
    raw = torch.randn(N_BANK, D, generator=g, device="cpu") * torch.rand(N_BANK, 1, generator=g, device="cpu") * 4
    recorded = indexer_row(rotated_at(raw, neox=True).float())
    bank_rows = mx_rows(recorded) if mx else recorded
    got = fill(bank_rows, "idx", group, D + 4, Rotary(TABLE, 1, D, ROPE, True, packing="indexer_mx" if mx
                                                      else "indexer"), backend, **placement).cpu()
    assert torch.equal(got[:N_BANK], bank_rows), "positions below the end keep their recorded bytes"
    keys, scales = decode_indexer(got, mx)
    held, _ = decode_indexer(bank_rows, mx)
    table = TABLE.double().numpy()
    for t in range(N_BANK, N_FILL):
        p = t % N_BANK
        want = held[p].numpy().copy()
        want[:ROPE] = turn(want[:ROPE], t, p, True, table)
        rule = 2.0 ** np.ceil(np.log2(max(np.abs(want).max(), 1e-4) / 448))
        s = float(scales[t])
        assert s in (rule / 2, rule, rule * 2) and np.abs(keys[t].numpy()).max() / s <= 448, (t, s, rule)
        err = np.abs(keys[t].numpy() - want)
        assert (err <= np.abs(want) / 16 * 1.01 + s * 2.0 ** -10).all(), (t, float(err.max()))
        assert not np.array_equal(keys[t, :ROPE].numpy(), held[p, :ROPE].numpy()), t
        if s == float(decode_indexer(bank_rows[p][None], mx)[1][0]):  # the same scale: the unrotated keys' bytes
            assert torch.equal(got[t, ROPE:D], bank_rows[p, ROPE:D]), t


@pytest.mark.parametrize("placement", [{}, {"bank_placement": "host", "staging_bytes": 1}], ids=["device", "host"])
def test_fp8_ds_mla_rows_past_the_end_turn_their_bf16_rope_part_only(placement, backend):
    g = torch.Generator(device="cpu").manual_seed(4)
    latent = torch.randn(N_BANK, 512, generator=g, device="cpu") * 3
    rope = rotated_at(torch.randn(N_BANK, ROPE, generator=g, device="cpu"), neox=False)
    bank_rows = pack_ds_mla(latent, rope.float())
    got = fill(bank_rows, "attn", ds_mla_group, DS_MLA_ROW, Rotary(TABLE, 1, ROPE, ROPE, False,
                                                                  packing="fp8_ds_mla"), backend, **placement).cpu()
    assert torch.equal(got[:N_BANK], bank_rows)
    eps = torch.finfo(torch.bfloat16).eps
    table = TABLE.double().numpy()
    for t in range(N_BANK, N_FILL):
        p = t % N_BANK
        assert torch.equal(got[t, :528], bank_rows[p, :528]), t  # fp8 latent and its scales: as recorded
        held = bank_rows[p, 528:].contiguous().view(torch.bfloat16).double().numpy()
        want = turn(held, t, p, False, table)
        have = got[t, 528:].contiguous().view(torch.bfloat16).double().numpy()
        assert np.abs(have - want).max() <= 2 * eps * np.abs(want).max(), t
        assert not np.array_equal(have, held), t


def test_packed_rows_are_refused_reordered_or_of_another_storage():
    from kvfill.kernels.rotary import Rerotation

    r = Rotary(TABLE, 1, D, ROPE, True, packing="indexer")
    with pytest.raises(ValueError, match=r"indexer rows are bytes in their cache's own order; got torch.bfloat16"):
        Rerotation(r, None, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match=r"reordered"):
        Rerotation(r, np.arange(D + 4)[::-1].copy(), torch.uint8, "cpu")
