"""A real training run changes seq_len mid-run (a schedule phase) on 2 ranks, then resumes
on 1 rank and changes it again (a phase added at the resume).

The loader's exactness is proven in tests/dataloader/test_seq_len_change.py; this checks
the trainer side: the schema's phases reach the loader at step boundaries, the model
trains at every length, the resume on another world size accepts the new seq_len, and the
skipped-token counter reaches metrics.jsonl.
"""

from __future__ import annotations

import pytest

from tests.utils.runs import REPO, check_ok, read_metrics, torchrun

TINY_MODEL = {"dim": 64, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden_dim": 128}
BLOCK, GROUP = 1024, 8


@pytest.mark.slow
def test_seq_len_changes_at_a_phase_and_at_a_resume_on_fewer_ranks(run_toml, tmp_path):
    run_dir = tmp_path / "run"
    sections = {
        "model": TINY_MODEL,
        "validation": {"enable": False},
        "training": {"steps": 4, "seq_len": 128, "local_batch_size": 2, "global_batch_size": 4},
        "dataloader": {
            "block_tokens": BLOCK,
            "shuffle_blocks": GROUP,
            "schedule": [{"start_step": 4, "seq_len": 256}],
        },
        "checkpoint": {"interval": 2, "keep_last": 0},
        # default hang_timeout_s: the first step at a new length compiles again (minutes on 2
        # loaded cores) and the watchdog gives it the first step's timeout (RunTrainer
        # .batch_generator -> watchdog.new_shape), so this run also proves that is no "hang"
    }
    check_ok(torchrun(run_toml(run_dir, **sections), 2, timeout=600))  # steps 1-4, 2 ranks
    # resume on 1 rank (2 accumulation steps), and add a phase at step 6 going to 64
    sections["training"]["steps"] = 6
    sections["dataloader"]["schedule"].append({"start_step": 6, "seq_len": 64})
    resumed = torchrun(run_toml(run_dir, **sections), 1, timeout=600)
    check_ok(resumed)
    assert "Training starts at step 5" in resumed.stdout + resumed.stderr
    rows = {r["step"]: r for r in read_metrics(run_dir, "train") if "loss" in r}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    # tokens per step = 4 sequences x the phase's seq_len: 128, 128, 128, 256, 256, 64
    assert rows[6]["tokens_seen"] == 4 * (3 * 128 + 2 * 256 + 64)
    assert rows[3]["data_skipped_tokens"] == 0
    # each change drops at most the rest of one group of blocks (one dataset)
    assert 0 < rows[6]["data_skipped_tokens"] <= 2 * GROUP * BLOCK


def test_long_context_config_plans_its_phases():
    """The shipped long-context stage: 8K -> 32K -> 64K -> 128K phases on 64 GPUs (CP 8),
    RoPE sized for 128K, every length split evenly by CP."""
    from train.build import to_trainer_config
    from train.config import check_launch, load_config

    run = load_config(REPO / "configs" / "llama3_8b_long_context.toml")
    assert check_launch(run, 64) == {"dp_replicate": 1, "dp_shard": 8, "tp": 1, "cp": 8}
    assert run.model.rope_scaling
    config = to_trainer_config(run, world_size=64, accelerator=True)
    assert config.training.seq_len == run.model.max_seq_len == 131072
    assert config.dataloader.start_seq_len == 8192
    assert [(p.start_sequence, p.seq_len) for p in config.dataloader.schedule] == [
        (500 * 64, 32768),
        (1500 * 64, 65536),
        (2500 * 64, 131072),
    ]
