"""`dataloader.prepare`'s merge: every task's markers checked, then each split's
documents.npy, provenance (`dataloader.provenance`) and manifest.json written (no token is
re-read) and the tokenizer installed.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import numpy as np

from common.io import atomic_path, write_json_atomic
from dataloader.manifest import DOCUMENTS_NAME, MANIFEST_NAME, Manifest, ShardInfo
from dataloader.prepare.plan import (
    SPLITS,
    TASKS_DIR,
    PrepareConfig,
    SplitStats,
    TokenizerInfo,
    marker_path,
    splits_of,
    stale_tasks,
    task_of_unit,
    task_options,
)
from dataloader.provenance import write_provenance
from dataloader.tokenizer import install_tokenizer, sha256_file


def _list_tasks(indices: list[int], limit: int = 20) -> str:
    shown = ", ".join(map(str, indices[:limit]))
    return shown + (f", ... ({len(indices)} in all)" if len(indices) > limit else "")


def merge(config: PrepareConfig, tok: TokenizerInfo) -> dict[str, Manifest]:
    """Check that every task finished with the same options, then write each split's
    documents.npy and manifest.json from the tasks' markers (no token is re-read)."""
    out = Path(config.out)
    num_tasks = config.num_tasks
    markers: list[dict] = []
    missing = []
    for index in range(num_tasks):
        try:
            markers.append(json.loads(marker_path(out, index, num_tasks).read_text()))
        except (OSError, json.JSONDecodeError):
            missing.append(index)
    if missing:
        raise ValueError(
            f"{out / TASKS_DIR}: task(s) {_list_tasks(missing)} of {num_tasks} have not "
            f"completed (no {marker_path(out, missing[0], num_tasks).name}"
            f"{', ...' if len(missing) > 1 else ''}); run just those again "
            f"(--task-index I, or sbatch --array={','.join(map(str, missing[:20]))}; "
            "scripts/slurm/submit_prepare.py resubmits exactly the unfinished ones), then merge"
        )
    options = task_options(config, tok, markers[0]["options"].get("num_units"))
    for index, marker in enumerate(markers):
        theirs = marker.get("options", {})
        for key, value in options.items():
            if theirs.get(key) != value:
                what = {
                    "tokenizer_sha256": "a different tokenizer",
                    "val_split_key": "an older prepare that split val by another rule",
                }.get(key, "different options")
                raise ValueError(
                    f"{marker_path(out, index, num_tasks)}: task {index} of {num_tasks} ran with "
                    f"{what}: {key}={theirs.get(key)!r}, but this merge has "
                    f"{key}={value!r}; every task and the merge must get the same --input, "
                    "--tokenizer/--train-tokenizer, --text-field, --doc-separator, "
                    "--val-fraction and --shard-chars. Rerun that task with them"
                )
    # Inputs changed (or shards lost or resized) since a task ran: its marker no longer
    # describes them (`marker_is_current` checks every shard's size).
    stale = stale_tasks(config, tok)
    if stale:
        raise ValueError(
            f"{out / TASKS_DIR}: task(s) {_list_tasks(stale)} of {num_tasks} are out of date "
            "(their input files changed, or shards they wrote are missing or resized, since "
            "they ran); run just those again "
            f"(--task-index I, or sbatch --array={','.join(map(str, stale[:20]))}), then merge"
        )
    num_units = options["num_units"]
    covered = sorted(int(u) for m in markers for u in m["units"])
    assert covered == list(range(num_units)), (covered, num_units)

    stats = {  # each count summed over the tasks
        s: SplitStats(*(sum(m["stats"][s][f.name] for m in markers) for f in fields(SplitStats)))
        for s in SPLITS
    }
    manifests = {}
    for split in splits_of(config):
        rows = []
        for u in range(num_units):
            marker = markers[task_of_unit(u, num_tasks)]
            rows += marker["units"][str(u)].get(split, [])
        if stats[split].num_documents == 0:
            what = (
                "the inputs"
                if split == "train"
                else f"the val split (--val-fraction {config.val_fraction})"
            )
            in_val = stats["val"].num_documents if split == "train" else 0  # all drawn to val
            raise ValueError(
                f"no non-empty documents in {what} {config.inputs} "
                f"({stats[split].num_empty_documents} empty"
                + (f", {in_val} went to the val split" if in_val else "")
                + "); check --input and --text-field"
                + (", or raise --val-fraction" if split == "val" else "")
                + (", or lower --val-fraction" if in_val else "")
            )
        manifests[split] = _write_split(out / split, split, rows, stats[split], config, tok)
    for split in SPLITS:
        if split not in manifests and (out / split / MANIFEST_NAME).exists():
            (out / split / MANIFEST_NAME).unlink()  # a stale val split from an earlier run
    if tok.source_dir.resolve() != (out / "tokenizer").resolve():
        install_tokenizer(tok.source_dir, None, out / "tokenizer")
    _report(out, manifests, stats)
    return manifests


def _write_documents(path: Path, shard_dir: Path, rows: list[dict], num_documents: int) -> None:
    """documents.npy (int64 starts, then the total) streamed shard by shard: memory does
    not grow with the corpus. Temp name + fsync + rename, like every other write here."""
    with atomic_path(path) as tmp:
        starts = np.lib.format.open_memmap(
            tmp, mode="w+", dtype=np.int64, shape=(num_documents + 1,)
        )
        starts[0] = 0
        at, total = 1, 0
        for row in rows:
            lengths = np.load(shard_dir / row["docs_file"])
            if len(lengths) != row["num_documents"]:
                raise ValueError(
                    f"{shard_dir / row['docs_file']}: {len(lengths)} documents, its sidecar "
                    f"records {row['num_documents']}; delete that task's marker in "
                    "prepare_tasks/ and rerun it"
                )
            np.cumsum(lengths, out=starts[at : at + len(lengths)])
            starts[at : at + len(lengths)] += total
            total += int(lengths.sum())
            at += len(lengths)
        assert at == num_documents + 1, (at, num_documents)
        starts.flush()
        del starts


def _write_split(split_dir, split, rows, stats, config, tok: TokenizerInfo) -> Manifest:
    shard_dir = split_dir / "shards"
    num_documents = sum(r["num_documents"] for r in rows)
    assert num_documents == stats.num_documents, (num_documents, stats.num_documents)
    # Files no task listed (temp files, an earlier run on other inputs or options) are stale.
    listed = {r["file"] for r in rows} | {r["docs_file"] for r in rows}
    listed |= {r["file"].removesuffix(".bin") + ".json" for r in rows}
    for stale in shard_dir.iterdir():
        if stale.name not in listed:
            stale.unlink()
    _write_documents(split_dir / DOCUMENTS_NAME, shard_dir, rows, num_documents)
    provenance = write_provenance(split_dir, (r["provenance"] for r in rows))
    assert provenance["num_documents"] == num_documents, (provenance, num_documents)
    provenance.pop("num_documents")
    manifest = Manifest(
        root=split_dir,
        split=split,
        tokenizer_sha256=tok.sha256,
        vocab_size=tok.vocab_size,
        bos_id=tok.bos_id,
        eos_id=tok.eos_id,
        dtype=tok.dtype,
        num_tokens=sum(r["num_tokens"] for r in rows),
        num_documents=num_documents,
        num_empty_documents=stats.num_empty_documents,
        num_replaced_chars=stats.num_replaced_chars,
        num_documents_with_replacements=stats.num_documents_with_replacements,
        on_exhausted=config.on_exhausted,
        documents_bytes=(split_dir / DOCUMENTS_NAME).stat().st_size,
        documents_sha256=sha256_file(split_dir / DOCUMENTS_NAME),
        shards=[
            ShardInfo(
                f"shards/{r['file']}", r["num_tokens"], r["num_documents"], r["bytes"], r["sha256"]
            )
            for r in rows
        ],
        inputs=list(config.inputs),
        provenance=provenance,
    )
    write_json_atomic(split_dir / MANIFEST_NAME, manifest.to_json())
    return Manifest.load(split_dir, verify=config.verify)


def _report(out: Path, manifests: dict[str, Manifest], stats: dict[str, SplitStats]) -> None:
    for split, manifest in manifests.items():
        s = stats[split]
        print(
            f"{out / split}: {manifest.num_documents} documents, {manifest.num_tokens} tokens "
            f"({manifest.dtype}) in {len(manifest.shards)} shards ({s.num_shards_kept} kept from an "
            f"earlier run); dropped {s.num_empty_documents} empty documents; replaced "
            f"{s.num_replaced_chars} undecodable bytes in {s.num_documents_with_replacements} documents"
        )
