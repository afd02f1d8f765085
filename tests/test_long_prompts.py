"""bench/long_prompts.py: long prompts of real text from the Python install
(code, prose, chat), a JSONL file kvfill's own prompt readers take, each
prompt at least --tokens tokens by the characters-a-token bound and under a
given tokenizer, with a sidecar naming every line's sources.  Small
(--tokens 2000) and cheap: a word-level tokenizer.json made here with
``tokenizers`` (bench/models.make_tokenizer's vocabulary, without the
transformers import)."""
import json

import pytest

from kvfill.bench import long_prompts
from kvfill.record.inputs import read_prompt_classes, read_prompt_lines, read_prompts

TOKENS = 2000


def _word_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 1024)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return str(folder)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The prompts file and sidecar, written twice in folders of their own."""
    root = tmp_path_factory.mktemp("long-prompts")
    tokenizer = _word_tokenizer(root / "words")
    outs = []
    for run in ("a", "b"):
        (root / run).mkdir()
        out = root / run / "long.jsonl"
        assert long_prompts.main(["--out", str(out), "--tokens", str(TOKENS), "--tokenizer", tokenizer]) == 0
        outs.append(out)
    return outs, tokenizer


def _sidecar(out):
    with open(long_prompts.sources_path(str(out))) as f:
        return json.load(f)


def _lines(out):
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_kvfill_reads_the_lines_with_their_classes(made):
    (out, _), _ = made
    classes = read_prompt_classes(str(out))
    assert classes == ["code", "code", "prose", "prose", "chat", "chat"]
    prompts = read_prompts(str(out))
    assert [no for no, _ in read_prompt_lines(str(out))] == [1, 2, 3, 4, 5, 6]
    assert prompts == [item["prompt"] for item in _lines(out)]
    assert all(set(item) == {"class", "prompt"} for item in _lines(out))


def test_every_prompt_reaches_the_length_by_the_bound_and_the_tokenizer(made):
    (out, _), tokenizer = made
    count = long_prompts.load_counter(tokenizer)
    for prompt in read_prompts(str(out)):
        assert len(prompt) >= TOKENS * long_prompts.CHARS_PER_TOKEN
        assert count(prompt) >= TOKENS
        assert len(prompt.split()) >= TOKENS  # the word-level tokenizer's count, by hand
    sidecar = _sidecar(out)
    assert all(line["tokens"] == {tokenizer: count(p)} for line, p in zip(sidecar["lines"], read_prompts(str(out))))


def test_a_tokenizer_that_counts_fewer_gets_more_text(made):
    """A bound of 1 character a token leaves the word-level tokenizer short
    (code runs ~10 characters a whitespace word), so documents are added
    until it counts the tokens asked."""
    _, tokenizer = made
    count = long_prompts.load_counter(tokenizer)
    bound_only = long_prompts.build(TOKENS, 2, chars_per_token=1, kinds=("code",))
    with_tokenizer = long_prompts.build(TOKENS, 2, [tokenizer], chars_per_token=1, kinds=("code",))
    assert any(count(p["prompt"]) < TOKENS for p in bound_only)
    assert all(count(p["prompt"]) >= TOKENS for p in with_tokenizer)
    for short, long in zip(bound_only, with_tokenizer):
        assert long["prompt"].startswith(short["prompt"])


def test_prompts_differ_and_share_no_source(made):
    (out, _), _ = made
    sidecar = _sidecar(out)
    prompts = read_prompts(str(out))
    assert len(set(prompts)) == len(prompts)
    names = [s["source"] for line in sidecar["lines"] for s in line["sources"]]
    assert len(names) == len(set(names)), "a document in two prompts"
    firsts = [line["sources"][0]["source"] for line in sidecar["lines"]]
    assert len(set(firsts)) == len(firsts)


def test_the_sidecar_names_each_lines_sources_in_order(made):
    """The prompt is its sources' text in the sidecar's order, whole: code
    each file after its ``# file:`` line, prose and chat paragraphs apart
    (chat after its request)."""
    (out, _), tokenizer = made
    sidecar = _sidecar(out)
    assert long_prompts.sources_path(str(out)).endswith("long.sources.json")
    assert sidecar["prompts"] == "long.jsonl" and sidecar["tokens"] == TOKENS and sidecar["tokenizers"] == [tokenizer]
    for line, prompt, kind in zip(sidecar["lines"], read_prompts(str(out)), read_prompt_classes(str(out))):
        assert line["class"] == kind and line["chars"] == len(prompt)
        loads = dict(long_prompts.kind_documents(kind))
        texts = [loads[source["source"]]() for source in line["sources"]]
        assert [len(t) for t in texts] == [source["chars"] for source in line["sources"]]
        if kind == "code":
            whole = "\n".join(f"# file: {source['source']}\n{text}" + ("" if text.endswith("\n") else "\n")
                              for source, text in zip(line["sources"], texts))
        else:
            whole = (line["request"] + "\n\n" if kind == "chat" else "") + "\n\n".join(texts)
        assert prompt == whole


def test_chat_prompts_open_with_the_request(made):
    (out, _), _ = made
    sidecar = _sidecar(out)
    chats = [(line, p) for line, p in zip(sidecar["lines"], read_prompts(str(out))) if line["class"] == "chat"]
    assert len(chats) == 2 and chats[0][1] != chats[1][1]
    for line, prompt in chats:
        assert line["request"] in long_prompts.CHAT_REQUESTS
        assert prompt.startswith(line["request"] + "\n\n") and len(line["request"].split()) < 40
    assert "Summarize the following document" in chats[0][1][:200]


def test_running_twice_writes_the_same_bytes(made):
    (a, b), _ = made
    assert a.read_bytes() == b.read_bytes()
    assert open(long_prompts.sources_path(str(a)), "rb").read() == open(long_prompts.sources_path(str(b)), "rb").read()


def test_too_many_tokens_are_refused_naming_the_value(tmp_path, capsys):
    out = tmp_path / "long.jsonl"
    with pytest.raises(SystemExit) as exc:
        long_prompts.main(["--out", str(out), "--tokens", "100000000"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--tokens 100000000" in err and "code" in err and "reaches" in err and "expected --tokens <=" in err
    assert not list(tmp_path.iterdir())


def test_a_path_kvfill_would_read_as_text_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        long_prompts.main(["--out", str(tmp_path / "long.txt"), "--tokens", "10"])
    assert ".jsonl" in capsys.readouterr().err
