"""dataloader.prepare on real files: round trips, formats, resume, bad inputs."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from dataloader.corpus import iter_documents
from dataloader.manifest import Manifest
from dataloader.prepare import PrepareConfig, prepare
from dataloader.prepare.plan import is_val
from dataloader.tokenizer import MAX_ENCODE_CHARS

REPO = Path(__file__).resolve().parents[3]


def decoded_documents(split_dir: Path, tokenizer: Tokenizer) -> list[str]:
    manifest = Manifest.load(split_dir, verify=True)
    starts = manifest.load_document_starts()
    tokens = np.concatenate(
        [np.fromfile(split_dir / s.file, dtype=manifest.dtype) for s in manifest.shards]
    )
    docs = []
    for a, b in zip(starts[:-1], starts[1:], strict=True):
        doc = tokens[a:b].tolist()
        assert doc[0] == manifest.bos_id and doc[-1] == manifest.eos_id
        docs.append(tokenizer.decode(doc[1:-1], skip_special_tokens=False))
    return docs


def run_prepare(inputs, out, tokenizer_dir, **kw) -> dict[str, Manifest]:
    return prepare(
        PrepareConfig(
            inputs=[str(i) for i in inputs],
            out=out,
            tokenizer=str(tokenizer_dir),
            num_workers=1,
            progress=False,
            **kw,
        )
    )


def test_shakespeare_round_trip_and_val_split(shakespeare_data):
    tokenizer = Tokenizer.from_file(str(shakespeare_data / "tokenizer" / "tokenizer.json"))
    documents = [d for d in iter_documents(["shakespeare"]) if d.text.strip()]
    expected_val = [d.text for d in documents if is_val(d, 0.05)]
    expected_train = [d.text for d in documents if not is_val(d, 0.05)]
    assert len(documents) > 700  # one document per scene of 38 plays
    assert 0 < len(expected_val) < 0.1 * len(documents)
    assert decoded_documents(shakespeare_data / "train", tokenizer) == expected_train
    assert decoded_documents(shakespeare_data / "val", tokenizer) == expected_val
    train = Manifest.load(shakespeare_data / "train")
    assert train.dtype == "uint16" and train.vocab_size == 2048 and len(train.shards) > 1
    assert train.add_bos and train.on_exhausted == "repeat"


def test_tokenizer_dir_agrees_across_torchtitan_and_transformers(shakespeare_data):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from transformers import AutoTokenizer

    tok_dir = shakespeare_data / "tokenizer"
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert (
        config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["add_bos_token"] is False
    )
    titan = HuggingFaceTokenizer(tokenizer_path=str(tok_dir))
    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    manifest = Manifest.load(shakespeare_data / "train")
    assert (titan.bos_id, titan.eos_id) == (manifest.bos_id, manifest.eos_id)
    assert hf.bos_token_id == manifest.bos_id and hf.eos_token_id == manifest.eos_id
    # The first stored training document equals what both libraries produce for its text.
    text = next(d.text for d in iter_documents(["shakespeare"]) if not is_val(d, 0.05))
    stored = np.fromfile(shakespeare_data / "train" / manifest.shards[0].file, dtype=manifest.dtype)
    stored = stored[: int(manifest.load_document_starts()[1])].tolist()
    assert titan.encode(text, add_bos=True, add_eos=True) == stored
    assert hf(text)["input_ids"] == stored[:-1]  # exactly one BOS, as in training
    assert hf.decode(stored, skip_special_tokens=True) == text


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "parquet", "textdir", "separator", "hf"])
def test_input_formats_round_trip(fmt, shakespeare_data, tiny_corpus, tmp_path):
    texts = ["First doc.\nWith two lines.", "Second: ünïcödé ✓", "Third document, the last one."]
    if fmt == "jsonl":
        src = tiny_corpus.jsonl(texts, field="body")
    elif fmt == "jsonl.gz":
        src = tiny_corpus.jsonl(texts, name="docs.jsonl.gz", field="body")
    elif fmt == "parquet":
        src = tiny_corpus.parquet(texts, field="body")
    elif fmt == "textdir":
        for i, t in enumerate(texts):
            tiny_corpus.text(t, name=f"sub/{i}.md")
        src = tiny_corpus.root
    elif fmt == "separator":
        texts = ["## A\nalpha\n", "## B\nbeta\n", "## C\ngamma"]
        src = tiny_corpus.text("".join(texts))
    else:
        import datasets

        src = tmp_path / "hf_ds"
        datasets.Dataset.from_dict({"body": texts}).save_to_disk(str(src))
    kw = {"doc_separator": r"^## "} if fmt == "separator" else {"text_field": "body"}
    run_prepare([src], tmp_path / "out", shakespeare_data / "tokenizer", **kw)
    tokenizer = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer" / "tokenizer.json"))
    assert decoded_documents(tmp_path / "out" / "train", tokenizer) == texts


def test_val_split_does_not_move_with_the_corpus(tmp_path):
    """The same documents go to val after the corpus is copied elsewhere and read through a
    path spelled another way (relative, through a symlink), in every input shape: a
    directory of files, a single file, a save_to_disk DatasetDict, the embedded corpus."""
    import datasets

    from tests.utils.corpus import TinyCorpus

    texts = [f"document {i} of the corpus" for i in range(80)]
    first = TinyCorpus(tmp_path / "site_a" / "corpus")
    first.jsonl(texts[:40], name="part-0.jsonl")
    (first.root / "nested").mkdir()
    first.parquet(texts[40:60], name="nested/part-1.parquet")
    first.text("## a\n" + "".join(f"## {t}\n" for t in texts[60:]), name="part-2.md")
    dataset_dict = datasets.DatasetDict({"a": datasets.Dataset.from_dict({"text": texts[:30]})})
    dataset_dict.save_to_disk(str(tmp_path / "site_a" / "hf_corpus"))
    second = tmp_path / "elsewhere" / "copied"
    shutil.copytree(tmp_path / "site_a", second)
    (tmp_path / "link").symlink_to(second)

    def val_of(site: Path, relative: bool = False) -> dict[str, list[str]]:
        root = Path(os.path.relpath(site)) if relative else site
        inputs = {
            "dir": [root / "corpus"],
            "file": [root / "corpus" / "part-0.jsonl"],
            "hf": [root / "hf_corpus"],
        }
        return {
            shape: [
                d.text
                for d in iter_documents(list(map(str, paths)), "text", "^## ")
                if is_val(d, 0.3)
            ]
            for shape, paths in inputs.items()
        }

    here = val_of(tmp_path / "site_a")
    assert all(0 < len(val) < 30 for val in here.values()), here
    assert val_of(second, relative=True) == here
    assert val_of(tmp_path / "link") == here
    # The embedded corpus is named inside its package, so its split is fixed everywhere.
    names = {d.split_name for d in iter_documents(["shakespeare"])}
    assert all(name.startswith("shakespeare/") for name in names) and len(names) > 30


def test_non_utf8_and_empty_documents_are_counted(shakespeare_data, tiny_corpus, tmp_path):
    tiny_corpus.text(b"good text\n", name="a.txt")
    tiny_corpus.text(b"bad \xff\xfe bytes\n", name="b.txt")
    tiny_corpus.text(b"   \n", name="c.txt")
    tiny_corpus.jsonl(["lone \ud800 half"], name="d.jsonl")  # valid JSON, not text
    e_txt = tiny_corpus.text("<|end_of_text|> is text <|begin_of_text|>", name="e.txt")
    manifest = run_prepare([tiny_corpus.root], tmp_path / "out", shakespeare_data / "tokenizer")[
        "train"
    ]
    assert manifest.num_documents == 4
    assert manifest.num_empty_documents == 1
    assert manifest.num_replaced_chars == 3 and manifest.num_documents_with_replacements == 2
    tokenizer = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer" / "tokenizer.json"))
    docs = decoded_documents(tmp_path / "out" / "train", tokenizer)
    assert docs[1:] == ["bad \ufffd\ufffd bytes\n", "lone \ufffd half", e_txt.read_text()]
    # a special token's text in a document is text: BOS and EOS only bound documents
    tokens = np.fromfile(tmp_path / "out" / "train" / manifest.shards[0].file, manifest.dtype)
    assert [(tokens == i).sum() for i in (manifest.bos_id, manifest.eos_id)] == [4, 4]


@pytest.mark.slow  # ~40 s: tokenizes 50 MB on one core
def test_huge_single_document_is_chunked(shakespeare_data, tiny_corpus, tmp_path):
    sentence = "Now is the winter of our discontent made glorious summer. "
    # 8 MB: eight of the tokenizer's encode pieces (MAX_ENCODE_CHARS characters each)
    text = sentence * (8 * MAX_ENCODE_CHARS // len(sentence))
    src = tiny_corpus.text(text, name="huge.txt")
    manifest = run_prepare([src], tmp_path / "out", shakespeare_data / "tokenizer")["train"]
    assert manifest.num_documents == 1
    tokenizer = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer" / "tokenizer.json"))
    tokens = np.fromfile(tmp_path / "out" / "train" / manifest.shards[0].file, dtype=manifest.dtype)
    expected = tokenizer.encode(sentence * 10, add_special_tokens=False).ids
    assert tokens[1 : 1 + len(expected)].tolist() == expected
    # every joint between pieces round-trips: the whole document decodes to its text
    assert tokenizer.decode(tokens[1:-1].tolist()) == text


def test_resume_keeps_finished_shards_and_rebuilds_the_rest(shakespeare_data, tmp_path):
    out = tmp_path / "out"
    kw = {"shard_chars": 300_000, "val_fraction": 0.1}
    first = run_prepare(["shakespeare"], out, shakespeare_data / "tokenizer", **kw)
    manifest_before = (out / "train" / "manifest.json").read_text()
    shards = sorted((out / "train" / "shards").glob("*.bin"))
    assert len(shards) >= 4
    # Simulate a crash: manifest and task marker not yet written, one shard half-written
    # under its temp name, one shard finished but its sidecar (the completion marker) missing.
    for split in ("train", "val"):
        (out / split / "manifest.json").unlink()
    (out / "prepare_tasks" / "task-00000-of-00001.json").unlink()
    torn, unmarked = shards[2], shards[3]
    unmarked.with_suffix(".json").unlink()
    (torn.parent / (torn.name + ".tmp")).write_bytes(torn.read_bytes()[:100])
    torn.unlink()
    kept_stats = {p.name: p.stat().st_mtime_ns for p in shards if p not in (torn, unmarked)}
    second = run_prepare(["shakespeare"], out, shakespeare_data / "tokenizer", **kw)
    assert (out / "train" / "manifest.json").read_text() == manifest_before
    assert second["train"].content_sha256 == first["train"].content_sha256
    for name, mtime in kept_stats.items():
        assert (out / "train" / "shards" / name).stat().st_mtime_ns == mtime, (
            f"{name} was rewritten"
        )
    assert not list((out / "train" / "shards").glob("*.tmp"))


def test_killed_prepare_subprocess_resumes_to_identical_manifest(shakespeare_data, tmp_path):
    args = [
        sys.executable,
        "-m",
        "dataloader.prepare",
        "--input",
        "shakespeare",
        "--tokenizer",
        str(shakespeare_data / "tokenizer"),
        "--shard-chars",
        "200000",
        "--num-workers",
        "1",
        "--no-progress",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    reference = tmp_path / "reference"
    subprocess.run(
        [*args, "--out", str(reference)], check=True, cwd=REPO, env=env, capture_output=True
    )
    out = tmp_path / "killed"
    proc = subprocess.Popen([*args, "--out", str(out)], cwd=REPO, env=env)
    shard_dir = out / "train" / "shards"
    try:
        while proc.poll() is None and len(list(shard_dir.glob("*.json"))) < 3:
            pass
        proc.kill()
    finally:
        proc.wait()
    assert not (out / "train" / "manifest.json").exists(), (
        "finished before the kill; lower --shard-chars"
    )
    subprocess.run([*args, "--out", str(out)], check=True, cwd=REPO, env=env, capture_output=True)
    assert (out / "train" / "manifest.json").read_text() == (
        reference / "train" / "manifest.json"
    ).read_text()


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dataloader.prepare", "--no-progress", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )


def test_cli_bad_inputs_print_one_error_line(shakespeare_data, tiny_corpus, tmp_path):
    tok = shakespeare_data / "tokenizer"
    cases = {
        "no such file": _cli(
            "--input", tmp_path / "nope.jsonl", "--tokenizer", tok, "--out", tmp_path / "o1"
        ),
        "no non-empty documents": _cli(
            "--input", tiny_corpus.jsonl([]), "--tokenizer", tok, "--out", tmp_path / "o2"
        ),
        "no field 'text'": _cli(
            "--input",
            tiny_corpus.jsonl(["x"], name="b.jsonl", field="body"),
            "--tokenizer",
            tok,
            "--out",
            tmp_path / "o3",
        ),
        "no tokenizer.json": _cli(
            "--input", "shakespeare", "--tokenizer", tmp_path, "--out", tmp_path / "o4"
        ),
        # its one document is hashed into val: said so, not "check --input"
        "(0 empty, 1 went to the val split); check --input and --text-field, or lower": _cli(
            "--input",
            tiny_corpus.jsonl(["x"], name="a.jsonl"),
            "--tokenizer",
            tok,
            "--val-fraction",
            "0.5",
            "--out",
            tmp_path / "o5",
        ),
    }
    for needle, result in cases.items():
        assert result.returncode == 2, (needle, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (
            result.stderr
        )


def _torn_gz(folder: Path) -> list[str]:
    whole = gzip.compress(b'{"text": "to be or not to be"}\n' * 1000)
    (folder / "torn.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    return ["--input", str(folder / "torn.jsonl.gz")]


def _not_gzip(folder: Path) -> list[str]:
    (folder / "plain.jsonl.gz").write_text('{"text": "to be"}\n')
    return ["--input", str(folder / "plain.jsonl.gz")]


def _not_parquet(folder: Path) -> list[str]:
    (folder / "x.parquet").write_text("not parquet")
    return ["--input", str(folder / "x.parquet")]


def _tokenizer_not_json(folder: Path) -> list[str]:
    (folder / "tokenizer.json").write_text('{"model": ')
    return ["--tokenizer", str(folder)]


def _out_under_a_file(folder: Path) -> list[str]:
    (folder / "a_file").write_text("")
    return ["--out", str(folder / "a_file" / "out")]


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        (_torn_gz, "torn.jsonl.gz: unreadable as jsonl (Compressed file ended"),
        (_not_gzip, "plain.jsonl.gz: unreadable as jsonl (Not a gzipped file"),
        (_not_parquet, "x.parquet: not a parquet file"),
        (_tokenizer_not_json, "tokenizer.json: not a Hugging Face tokenizer.json"),
        (_out_under_a_file, "a_file/out/train/shards: Not a directory; check that path"),
    ],
    ids=["torn-gz", "not-gzip", "not-parquet", "tokenizer-not-json", "out-under-a-file"],
)
def test_unreadable_input_is_one_line_naming_the_file(
    bad, needle, shakespeare_data, tmp_path, capsys
):
    """Each was a traceback (gzip's EOFError, tokenizers' bare Exception, NotADirectoryError)
    or a line naming no file (pyarrow's)."""
    from dataloader.prepare.__main__ import main

    args = {"--input": "shakespeare", "--tokenizer": str(shakespeare_data / "tokenizer")}
    args |= {"--out": str(tmp_path / "out"), "--num-workers": "1"}
    flags = bad(tmp_path)
    args |= dict(zip(flags[::2], flags[1::2], strict=True))
    assert main([x for pair in args.items() for x in pair] + ["--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err, err


def test_manifest_refuses_damaged_or_mismatched_data(shakespeare_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(shakespeare_data, data)
    split = data / "train"
    manifest = Manifest.load(split, verify=True)
    shard = split / manifest.shards[1].file

    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0xFF  # same size, different content
    shard.write_bytes(bytes(raw))
    Manifest.load(split)  # sizes still match
    with pytest.raises(ValueError, match=f"{shard.name}: sha256 mismatch"):
        Manifest.load(split, verify=True)

    shard.write_bytes(bytes(raw[:-2]))
    with pytest.raises(ValueError, match=f"{shard.name}: .* bytes, manifest records"):
        Manifest.load(split)

    shard.unlink()
    with pytest.raises(ValueError, match=f"{shard.name}: missing file"):
        Manifest.load(split)

    with pytest.raises(ValueError, match="vocab 2048 is larger than the model's vocab_size 1000"):
        manifest.check_vocab(1000)
    manifest.check_vocab(2048)

    other = tmp_path / "other_tok"
    other.mkdir()
    from dataloader.tokenizer import train_bpe

    (other / "tokenizer.json").write_text(
        train_bpe(["a different corpus entirely"] * 10, 300).to_str()
    )
    with pytest.raises(ValueError, match="prepared with a different tokenizer"):
        manifest.check_tokenizer(other / "tokenizer.json")
    manifest.check_tokenizer(shakespeare_data / "tokenizer" / "tokenizer.json")

    with pytest.raises(ValueError, match="no manifest"):
        Manifest.load(tmp_path / "nowhere")


def test_process_pool_matches_single_process(shakespeare_data, tmp_path):
    """The multi-core path (spawned worker pool) writes exactly the same data."""
    kw = {"shard_chars": 500_000, "val_fraction": 0.05}
    pooled = prepare(
        PrepareConfig(
            inputs=["shakespeare"],
            out=tmp_path / "pool",
            tokenizer=str(shakespeare_data / "tokenizer"),
            num_workers=2,
            progress=False,
            **kw,
        )
    )
    single = run_prepare(["shakespeare"], tmp_path / "single", shakespeare_data / "tokenizer", **kw)
    for split in ("train", "val"):
        assert pooled[split].content_sha256 == single[split].content_sha256


# ---- distributed prepare: --num-tasks / --task-index / --merge ----------------------
def scene_files(tiny_corpus, num_files: int = 7) -> list[Path]:
    """jsonl files of ~30 KB (Shakespeare scenes, plus an empty document each): with
    shard_chars 12,000 every file is its own work unit, cut into a few chunks."""
    scenes = [d.text[:1500] for d in iter_documents(["shakespeare"]) if d.text.strip()]
    return [
        tiny_corpus.jsonl([*scenes[i * 20 : (i + 1) * 20], "  "], name=f"part{i}.jsonl")
        for i in range(num_files)
    ]


def assert_same_dataset(a: Path, b: Path, splits=("train", "val")) -> None:
    """Same documents, tokens, order, shard files and provenance: the index, the manifest,
    the provenance runs and sources and every shard are the same bytes (so content_sha256
    is equal too)."""
    for split in splits:
        ma, mb = Manifest.load(a / split, verify=True), Manifest.load(b / split, verify=True)
        assert ma.content_sha256 == mb.content_sha256
        assert ma.provenance and ma.provenance["num_runs"] > 0
        for name in ("manifest.json", "documents.npy", "provenance.npy", "sources.json"):
            assert (a / split / name).read_bytes() == (b / split / name).read_bytes(), name
        for shard in ma.shards:
            assert (a / split / shard.file).read_bytes() == (b / split / shard.file).read_bytes()


def task_args(files, out, tok, *extra) -> list[str]:
    args = [a for f in files for a in ("--input", str(f))]
    return [
        *args,
        "--out",
        str(out),
        "--val-fraction",
        "0.2",
        "--shard-chars",
        "12000",
        "--num-workers",
        "1",
        "--no-progress",
        *tok,
        *map(str, extra),
    ]


@pytest.mark.parametrize("name", ["SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_ID"])
def test_a_non_integer_slurm_array_variable_is_named(name, tmp_path, monkeypatch, capsys):
    from dataloader.prepare.__main__ import main

    monkeypatch.setenv(name, "x")
    assert main(["--inputs", "shakespeare", "--out", str(tmp_path / "out")]) == 2
    assert f"environment variable {name}='x' is not an integer" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("num_tasks", [3, 9])  # 9 > 7 work units: two tasks have nothing to do
def test_tasks_then_merge_equal_single_process(
    num_tasks, shakespeare_data, tiny_corpus, tmp_path, monkeypatch
):
    from dataloader.prepare.__main__ import main

    files = scene_files(tiny_corpus)
    tok = ["--tokenizer", str(shakespeare_data / "tokenizer")]
    assert main(task_args(files, tmp_path / "single", tok)) == 0
    # Tasks in reverse order, each as a SLURM array element would see it (index and
    # count from the environment).
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", str(num_tasks))
    for index in reversed(range(num_tasks)):
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", str(index))
        assert main(task_args(files, tmp_path / "multi", tok)) == 0
        assert not (tmp_path / "multi" / "train" / "manifest.json").exists()
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID")
    assert main(task_args(files, tmp_path / "multi", tok, "--merge")) == 0
    assert_same_dataset(tmp_path / "single", tmp_path / "multi")
    manifest = Manifest.load(tmp_path / "multi" / "train")
    assert len(manifest.shards) > 7 and manifest.num_empty_documents + Manifest.load(
        tmp_path / "multi" / "val"
    ).num_empty_documents == len(files)


def test_train_tokenizer_once_then_tasks(tiny_corpus, tmp_path, capsys):
    from dataloader.prepare.__main__ import main

    files = scene_files(tiny_corpus, 3)
    tok = ["--train-tokenizer", "400"]
    assert main(task_args(files, tmp_path / "single", tok)) == 0
    multi = tmp_path / "multi"
    capsys.readouterr()
    # A task must not train its own tokenizer: N tasks would each train one.
    assert main(task_args(files, multi, tok, "--num-tasks", 2, "--task-index", 0)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "must be trained once before the tasks" in err[0], err
    assert "--tokenizer-only" in err[0]
    assert main(task_args(files, multi, tok, "--tokenizer-only")) == 0
    assert not (multi / "train").exists()
    for index in (1, 0):
        assert main(task_args(files, multi, tok, "--num-tasks", 2, "--task-index", index)) == 0
    assert main(task_args(files, multi, tok, "--num-tasks", 2, "--merge")) == 0
    tok_json = "tokenizer/tokenizer.json"
    assert (multi / tok_json).read_bytes() == (tmp_path / "single" / tok_json).read_bytes()
    assert_same_dataset(tmp_path / "single", multi)


def one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_merge_and_task_bad_inputs_print_one_error_line(
    shakespeare_data, tiny_corpus, tmp_path, capsys, monkeypatch
):
    from dataloader.prepare.__main__ import main
    from dataloader.tokenizer import train_bpe

    files = scene_files(tiny_corpus, 4)
    tok = ["--tokenizer", str(shakespeare_data / "tokenizer")]
    out = tmp_path / "out"
    for index in (0, 2):
        assert main(task_args(files, out, tok, "--num-tasks", 4, "--task-index", index)) == 0
    capsys.readouterr()
    assert main(task_args(files, out, tok, "--num-tasks", 4, "--merge")) == 2
    line = one_error_line(capsys)
    assert "task(s) 1, 3 of 4 have not completed" in line and "--array=1,3" in line, line

    # Task 1 with another tokenizer, task 3 with another --shard-chars.
    other = tmp_path / "other_tok"
    other.mkdir()
    (other / "tokenizer.json").write_text(train_bpe(["something else entirely"] * 5, 300).to_str())
    assert (
        main(
            task_args(files, out, ["--tokenizer", str(other)], "--num-tasks", 4, "--task-index", 1)
        )
        == 0
    )
    assert main(task_args(files, out, tok, "--num-tasks", 4, "--task-index", 3)) == 0
    capsys.readouterr()
    assert main(task_args(files, out, tok, "--num-tasks", 4, "--merge")) == 2
    line = one_error_line(capsys)
    assert "task-00001-of-00004.json" in line and "a different tokenizer" in line, line
    assert main(task_args(files, out, tok, "--num-tasks", 4, "--task-index", 1)) == 0
    capsys.readouterr()
    assert main(task_args(files, out, tok, "--num-tasks", 4, "--merge", "--shard-chars", 9000)) == 2
    line = one_error_line(capsys)
    assert "shard_chars=12000" in line and "shard_chars=9000" in line, line
    assert not (out / "train" / "manifest.json").exists()
    assert main(task_args(files, out, tok, "--num-tasks", 4, "--merge")) == 0

    # A resubmitted subset: SLURM_ARRAY_TASK_COUNT is 1, the index is 2.
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "1")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    assert main(task_args(files, out, tok)) == 2
    assert "pass --num-tasks explicitly" in one_error_line(capsys)
    monkeypatch.delenv("SLURM_ARRAY_TASK_COUNT")
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID")
    assert main(task_args(files, out, tok, "--num-tasks", 4)) == 2
    assert "--task-index I" in one_error_line(capsys)


def test_failed_task_reruns_alone_and_finished_tasks_are_skipped(
    shakespeare_data, tiny_corpus, tmp_path, capsys
):
    from dataloader.prepare import prepare
    from dataloader.prepare.__main__ import parse_args
    from dataloader.prepare.plan import pending_tasks

    files = scene_files(tiny_corpus, 6)
    good = files[4].read_bytes()  # unit 4 -> task 1 of 3
    files[4].write_bytes(good + b"{not json\n")
    tok = ["--tokenizer", str(shakespeare_data / "tokenizer")]
    out = tmp_path / "out"

    def config(*extra):
        return parse_args(task_args(files, out, tok, "--num-tasks", 3, *map(str, extra)))

    prepare(config("--task-index", 0))
    with pytest.raises(ValueError, match=r"part4.jsonl:22: not valid JSON"):
        prepare(config("--task-index", 1))
    prepare(config("--task-index", 2))
    assert pending_tasks(config("--merge")) == [1]
    with pytest.raises(ValueError, match=r"task\(s\) 1 of 3 have not completed"):
        prepare(config("--merge"))

    files[4].write_bytes(good)
    shard_dir = out / "train" / "shards"
    before = {p: p.stat().st_mtime_ns for p in shard_dir.iterdir()}
    capsys.readouterr()
    for index in (0, 1, 2):
        prepare(config("--task-index", index))
    log = capsys.readouterr().out
    assert "task 0 of 3: already complete" in log and "task 2 of 3: already complete" in log
    assert "task 1 of 3: already complete" not in log
    for path, mtime in before.items():
        assert path.stat().st_mtime_ns == mtime, f"{path.name} was rewritten"
    prepare(config("--merge"))
    prepare(parse_args(task_args(files, tmp_path / "single", tok)))
    assert_same_dataset(tmp_path / "single", out)

    # An input changed after its task finished: that task is no longer complete, and the
    # merge refuses its stale shards.
    files[2].write_bytes(files[2].read_bytes() + b'{"text": "one more"}\n')
    assert pending_tasks(config("--merge")) == [2]
    with pytest.raises(ValueError, match=r"task\(s\) 2 of 3 are out of date"):
        prepare(config("--merge"))


def test_readme_jsonl_gz_command(shakespeare_data, tiny_corpus, tmp_path):
    """The README's "your own data" command, flag for flag, on a small jsonl.gz corpus."""
    texts = [f"Document {i}: " + "words of the play " * (i + 1) for i in range(60)]
    src = tiny_corpus.jsonl(texts, name="corpus.jsonl.gz", field="text")
    out = tmp_path / "mycorpus"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dataloader.prepare",
            "--input",
            str(src),
            "--text-field",
            "text",
            "--tokenizer",
            str(Path(shakespeare_data) / "tokenizer"),
            "--out",
            str(out),
            "--val-fraction",
            "0.1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    train, val = Manifest.load(out / "train"), Manifest.load(out / "val")
    assert train.num_documents + val.num_documents == len(texts)
    assert 0 < val.num_documents < len(texts) // 2
    tokenizer = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    got = decoded_documents(out / "train", tokenizer) + decoded_documents(out / "val", tokenizer)
    assert sorted(got) == sorted(texts)


# ------------------------------------------------------------- non-string text values

NON_STRING_TEXTS = {"int": 123, "float": 4.5, "bool": True, "list": [1, 2], "dict": {"a": 1}}


def _write_records(root: Path, kind: str, values: list) -> Path:
    """One input of `kind` whose "text" field holds `values` (any JSON-able type)."""
    root.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        path = root / "docs.jsonl"
        path.write_text("".join(json.dumps({"text": v}) + "\n" for v in values))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = root / "docs.parquet"
        pq.write_table(pa.table({"text": values}), path)
    else:
        import datasets

        path = root / "hf"
        datasets.Dataset.from_dict({"text": values}).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "hf"])
@pytest.mark.parametrize("value", list(NON_STRING_TEXTS.values()), ids=list(NON_STRING_TEXTS))
def test_non_string_text_values_are_refused_in_every_format(tmp_path, kind, value):
    path = _write_records(tmp_path, kind, [value, value])
    with pytest.raises(ValueError) as info:
        list(iter_documents([str(path)]))
    message = str(info.value)
    assert str(path) in message and "field 'text' holds" in message, message
    assert type(value).__name__ in message and "--text-field" in message, message


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "hf"])
def test_null_text_values_are_empty_documents(tmp_path, kind):
    path = _write_records(tmp_path, kind, ["a play", None])
    assert [d.text for d in iter_documents([str(path)])] == ["a play", ""]


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_cli_names_file_and_field_of_integer_texts(shakespeare_data, tmp_path, kind):
    path = _write_records(tmp_path / "raw", kind, [7, 8])
    tok = shakespeare_data / "tokenizer"
    result = _cli("--input", path, "--tokenizer", tok, "--out", tmp_path / "out")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    where = f"{path}: row 0" if kind == "parquet" else f"{path}:1"
    assert f"{where}: field 'text' holds int 7, not text; pass --text-field" in lines[0]
