"""Replay under prefix caching: a block's rows are a function of the tokens up
to its end (bank.py, "Which sequence a block replays"), so requests that share
a cached block agree on it and a recorded prompt replays its own rows
whatever ran before it - with recorded sequences of different lengths too
(the one covering most of the block's prefix wins)."""
import hashlib

import numpy as np
import pytest
import torch

from kvfill.kernels import Bank, BankIndex, DcpGeometry

N = 64  # recorded positions


def index_of(*recorded, num_sequences=None):
    tokens = [list(t[:N]) for t in recorded]
    return BankIndex(num_sequences or len(tokens), N, tokens)


def prompt(seed, n=N):
    return np.random.default_rng(seed).integers(1, 30000, n).tolist()


def test_a_recorded_prompt_replays_its_own_sequence_at_every_block_end():
    b = prompt(1, 100)  # longer than the recording: its blocks past N wrap in its own sequence
    idx = index_of(prompt(0), b, prompt(2))
    assert idx.sequences_for(b, [16, 32, 64, 80, 99]).tolist() == [1] * 5
    assert idx.sequence_for(b) == 1


def test_a_prompt_sharing_a_recorded_beginning_replays_it_there_and_its_own_prefix_hash_after():
    b = prompt(1)
    a = b[:32] + prompt(9, 40)
    idx = index_of(prompt(0), b, prompt(2), num_sequences=3)
    got = idx.sequences_for(a, [16, 32, 48, 72])
    assert got[:2].tolist() == [1, 1], "blocks inside the shared beginning hold the recorded rows"
    for e, s in zip([48, 72], got[2:]):
        digest = hashlib.sha256(np.asarray(a[:e], dtype=np.int64).tobytes()).digest()
        assert s == int.from_bytes(digest[:8], "little") % 3


def test_two_prompts_sharing_a_prefix_agree_on_every_block_inside_it():
    idx = index_of(prompt(0), prompt(1), prompt(2), num_sequences=3)
    rng = np.random.default_rng(5)
    for trial in range(30):
        shared = int(rng.integers(1, 90))
        x = prompt(100 + trial, shared) + prompt(200 + trial, 20)
        y = x[:shared] + prompt(300 + trial, 20)
        ends = np.arange(1, shared + 1)
        assert np.array_equal(idx.sequences_for(x, ends), idx.sequences_for(y, ends))


def test_recorded_prompts_with_a_common_beginning_share_the_lowest_numbered_one_there():
    b0 = prompt(1)
    b1 = b0[:40] + prompt(3, N - 40)
    idx = index_of(prompt(0), b0, b1)
    assert idx.sequences_for(b1, [16, 40, 41, 64]).tolist() == [1, 1, 2, 2]
    assert idx.sequences_for(b0, [16, 40, 41, 64]).tolist() == [1, 1, 1, 1]


def test_without_recorded_tokens_blocks_spread_over_the_sequences_by_prefix_hash():
    idx = BankIndex(4, N)
    picks = {int(idx.sequences_for(prompt(s, 30), [30])[0]) for s in range(60)}
    assert picks == {0, 1, 2, 3}


def test_the_planner_asks_each_block_for_the_sequence_of_its_end():
    from kvfill.connector.planner import GroupGeometry, GroupKind, Planner

    geos = [GroupGeometry("full", GroupKind.FULL_ATTENTION, 4),
            GroupGeometry("dcp", GroupKind.FULL_ATTENTION, 4, DcpGeometry(2, 0, 1))]
    asked = []

    def sequences_at(ends):
        asked.append(ends.tolist())
        return ends % 7

    planner = Planner(geos)
    sel = planner.select("r", 19, 5, [list(range(10, 15)), list(range(20, 23))], sequences_at=sequences_at)
    # tokens [5, 18) of 19: full blocks 1..4 end at 8, 12, 16, 19 (the request's end, not the fill's);
    # DCP span 8: blocks 0..2 end at 8, 16, 19
    assert asked == [[8, 12, 16, 19]]
    assert list(sel.groups[0].sequences) == [8 % 7, 12 % 7, 16 % 7, 19 % 7]
    assert list(sel.groups[1].sequences) == [8 % 7, 16 % 7, 19 % 7]
    plan = planner.plan([sel])
    assert plan.groups["full"].sequence.tolist() == [1, 5, 2, 5]
    # Block granularity fills the same blocks whole: each still replays its own end's sequence.
    asked.clear()
    whole = Planner(geos, granularity="block").select("r", 19, 5, [list(range(10, 15)), list(range(20, 23))],
                                                       sequences_at=sequences_at)
    assert asked == [[8, 12, 16, 19]] and list(whole.groups[0].sequences) == [1, 5, 2, 5]


# ------------------------------------------------- ragged sequences (coverage)
def _hash_pick(ids, num_sequences):
    digest = hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).digest()
    return int.from_bytes(digest[:8], "little") % num_sequences


def reference_pick(recorded, ids, e):
    """The rule of bank.py, spelled out: of the sequences whose tokens equal
    the prompt's below min(E, N_s), the one covering most of [0, E), the
    lowest-numbered among equals; else the prefix hash."""
    best, cover = -1, 0
    for s, t in enumerate(recorded):
        n = min(e, len(t))
        if list(t[:n]) == list(ids[:n]) and n > cover:
            best, cover = s, n
    return best if best >= 0 else _hash_pick(ids[:e], len(recorded))


def ragged_index():
    """Sequences X (60), A (100), Y (30), B = A + 150 more (250): B after A."""
    a = prompt(20, 100)
    b = a + prompt(21, 150)
    recorded = [prompt(22, 60), a, prompt(23, 30), b]
    return BankIndex(4, [len(t) for t in recorded], recorded), recorded


def test_a_longer_recording_of_a_shared_beginning_replays_past_the_shorter_ones_end():
    idx, (_, a, _, b) = ragged_index()
    assert idx.lengths.tolist() == [60, 100, 30, 250] and idx.num_positions == 250
    ends = np.arange(16, 251, 16).tolist() + [99, 100, 101, 249, 250]
    got = dict(zip(ends, idx.sequences_for(b, ends).tolist()))
    # up to A's end A and B cover [0, E) alike: the lower-numbered, A (the same tokens: the same rows)
    assert {e: s for e, s in got.items() if e <= 100} == {e: 1 for e in ends if e <= 100}
    # past it only B covers [0, E): B's own rows, never A's wrapped ones
    assert {e: s for e, s in got.items() if e > 100} == {e: 3 for e in ends if e > 100}
    assert idx.sequence_for(b) == 3
    # A's blocks replay A; A itself at its end too
    assert idx.sequences_for(a, [16, 50, 99, 100]).tolist() == [1, 1, 1, 1] and idx.sequence_for(a) == 1


def test_a_prompt_longer_than_every_recording_gets_the_longest_qualifying_one():
    idx, (_, a, _, b) = ragged_index()
    longer = b + prompt(24, 50)  # 300 tokens: past B's end B still covers most
    assert idx.sequences_for(longer, [100, 101, 250, 251, 300]).tolist() == [1, 3, 3, 3, 3]
    # a prompt extending A another way than B: A qualifies past 100 (wrapping), B no longer
    other = a + prompt(25, 80)
    assert idx.sequences_for(other, [100, 101, 180]).tolist() == [1, 1, 1]
    # sharing B's first 120 tokens: B up to 120; past it B differs, A still qualifies (its 100 tokens agree)
    fork = b[:120] + prompt(26, 40)
    assert idx.sequences_for(fork, [100, 120, 121, 160]).tolist() == [1, 3, 1, 1]


def test_unrecorded_prompts_fall_back_to_the_prefix_hash():
    idx, recorded = ragged_index()
    for seed in range(30, 40):
        p = prompt(seed, 70)
        ends = [1, 16, 33, 70]
        assert idx.sequences_for(p, ends).tolist() == [_hash_pick(p[:e], 4) for e in ends]
    # a prompt agreeing with Y (30 tokens) only for 20: hash from the first block that Y no longer covers
    y = recorded[2]
    p = y[:20] + prompt(41, 40)
    assert idx.sequences_for(p, [16, 20, 21, 60]).tolist() == [2, 2, _hash_pick(p[:21], 4), _hash_pick(p, 4)]


def test_a_recorded_ragged_prompt_replays_its_own_rows_whatever_its_length():
    recorded = [prompt(50 + s, n) for s, n in enumerate([5, 17, 64, 3, 200])]
    idx = BankIndex(len(recorded), [len(t) for t in recorded], recorded)
    for s, t in enumerate(recorded):
        ends = sorted({1, len(t) // 2 or 1, len(t)})
        assert idx.sequences_for(t, ends).tolist() == [s] * len(ends), s


def test_the_choice_depends_only_on_the_tokens_up_to_the_blocks_end():
    """Property (small): recorded sequences of a two-token alphabet and
    lengths around the index's 16-token first comparison share beginnings
    often; for random prompts and ends, the pick equals the rule spelled out
    and is the same for prompt[:E] and for prompt[:E] + any tail."""
    rng = np.random.default_rng(7)
    for trial in range(40):
        lengths = rng.integers(1, 40, int(rng.integers(1, 6))).tolist()
        base = rng.integers(1, 3, 40).tolist()
        recorded = [base[:n] if rng.random() < 0.6 else rng.integers(1, 3, n).tolist() for n in lengths]
        idx = BankIndex(len(recorded), lengths, recorded)
        p = (base if rng.random() < 0.7 else rng.integers(1, 3, 40).tolist())[:int(rng.integers(1, 41))]
        p = p + rng.integers(1, 3, int(rng.integers(0, 20))).tolist()
        ends = np.arange(1, len(p) + 1)
        got = idx.sequences_for(p, ends).tolist()
        assert got == [reference_pick(recorded, p, e) for e in ends], (trial, lengths)
        for e in ends.tolist():
            tail = rng.integers(1, 3, int(rng.integers(0, 10))).tolist()
            assert idx.sequences_for(p[:e], [e])[0] == got[e - 1]
            assert idx.sequences_for(p[:e] + tail, [e])[0] == got[e - 1], (trial, e)


def test_a_ragged_bank_and_its_file_choose_alike(tmp_path):
    pytest.importorskip("safetensors")
    _, recorded = ragged_index()
    rows = torch.zeros(sum(len(t) for t in recorded), 4, dtype=torch.bfloat16, device="cpu")
    bank = Bank({"l": rows}, sequence_lengths=[len(t) for t in recorded], sequence_tokens=recorded)
    bank.save(tmp_path / "b.safetensors")
    from_file = BankIndex.read(tmp_path / "b.safetensors")
    probe = recorded[3] + prompt(27, 20)
    ends = list(range(1, len(probe) + 1, 7))
    assert bank.index.sequences_for(probe, ends).tolist() == from_file.sequences_for(probe, ends).tolist() \
        == [reference_pick(recorded, probe, e) for e in ends]


# ---------------------------------------------------------------- through vLLM
BS = 16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def _bank_file(tmp_path, recorded, heads=2, head_size=8, sequences=3):
    pytest.importorskip("safetensors")
    g = torch.Generator(device="cpu").manual_seed(11)
    rows = {n: torch.randn(sequences, N, 2 * heads * head_size, generator=g, device="cpu").to(torch.bfloat16)
            for n in LAYERS}
    tokens = [list(t[:N]) for t in recorded] + [prompt(50 + i) for i in range(sequences - len(recorded))]
    path = tmp_path / "bank.safetensors"
    Bank(rows, sequence_tokens=tokens).save(path)
    return str(path), rows


def _old_rule(ids, num_sequences):
    digest = hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).digest()
    return int.from_bytes(digest[:8], "little") % num_sequences


def test_prefix_cached_blocks_of_an_unrecorded_prompt_hold_the_recorded_prompts_rows(tmp_path):
    """vLLM's scheduler with prefix caching: A (not recorded, shares B's first
    32 tokens) runs first; B (recorded) then reuses A's two cached blocks.
    Every position of B must hold B's recorded row, the shared blocks included."""
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_harness import make_harness

    b = prompt(1, N)
    tail = 0
    while _old_rule(b[:32] + prompt(700 + tail, 18), 3) == 0:  # a whole-prompt pick would differ from B's
        tail += 1
    a = b[:32] + prompt(700 + tail, 18)
    path, rows = _bank_file(tmp_path, [b])
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    h = make_harness(tmp_path, [(LAYERS, spec)], extra={"bank": path}, prefix_caching=True)
    h.add("a", a, max_tokens=1)
    out, _ = h.step()
    a_blocks = list(out.scheduled_new_reqs[0].block_ids[0])
    h.step()
    assert "a" not in h.scheduler.requests
    h.add("b", b, max_tokens=2)
    out, meta = h.step()
    table = h.block_table("b")[0]
    assert table[:2] == a_blocks[:2], "B did not reuse A's two cached blocks"
    engine = h.worker.worker.engine
    from kvfill.kernels import GroupFill

    group = next(iter(engine.groups))
    k = np.arange(len(b) - 1) // BS
    used = sorted(set(k.tolist()))
    plan = {group: GroupFill([table[i] for i in used], slot_end=[min(BS, len(b) - 1 - i * BS) for i in used],
                             local_base=[i * BS for i in used], sequence=[0] * len(used))}
    report = engine.verify(plan)
    assert report.ok, f"B's blocks hold other rows than B's recorded ones: {report}"


def test_a_bank_with_startup_fill_is_refused_naming_both_keys(tmp_path):
    from kvfill.connector.options import FillOptions, OptionError

    path, _ = _bank_file(tmp_path, [prompt(1)])
    with pytest.raises(OptionError, match=r"\['startup_fill'\] = True is invalid; expected false with 'bank'"):
        FillOptions.from_extra_config({"bank": path, "startup_fill": True})


@pytest.mark.cpu_only
@pytest.mark.e2e
def test_replay_after_prefix_cached_decoys_equals_real_prefill_end_to_end(tmp_path):
    """vLLM CPU end to end, prefix caching on: unrecorded decoys sharing each
    recorded prompt's first 256 tokens (two 128-token blocks) run first; the
    recorded prompts then reuse the decoys' blocks and still decode exactly as
    real prefill does (with a whole-prompt sequence choice: 0/3 here); Model
    Runner V2; the bank kept in host memory, each step's rows staged
    (``--bank-placement host``: its log says so)."""
    pytest.importorskip("vllm")
    from conftest import check_preset

    rc, data, work = check_preset(tmp_path, ["llama", "--lens", "300", "300", "300", "--", "--output-len", "4",
                                          "--fills", "replay", "--enable-prefix-caching", "--decoys", "256",
                                          "--in-process", "--bank-placement", "host"], runner="v2")
    replay = data["comparison"]["replay"]["tokens"]
    assert rc == 0, data["verdicts"]
    assert (replay["equal"], replay["total"]) == (12, 12) and replay["max_abs_logprob_diff"] <= 1e-4, replay
    hits = {run: data["steps"][run]["counters"]["prefix_cache_hit_tokens"] for run in ("prefill", "replay")}
    assert hits["prefill"] == hits["replay"] >= 3 * 256, hits  # each prompt found the decoy's blocks of 256 tokens
    assert any(line.startswith("prefix caching: after unrecorded decoys sharing each prompt's first 256 tokens")
               for line in data["verdicts"]), data["verdicts"]
    logs = "".join(p.read_text(errors="replace") for p in work.rglob("*.log"))
    assert "bank kept on the host - bank_placement 'host'" in logs and "bank in host memory: " in logs


def test_a_bank_holds_a_prompt_when_one_sequence_starts_with_all_its_tokens():
    """kvfill-check's bank line: which prompts replay their own rows in every block."""
    a, b = prompt(0), prompt(1)
    idx = index_of(a, b)
    assert idx.holds(a) and idx.holds(b[:10])
    assert not idx.holds(a + [5]) and not idx.holds(prompt(2)) and not idx.holds(a[:9] + b[9:20])
    assert not BankIndex(4, N).holds(a)  # no token ids recorded: nothing is known held
