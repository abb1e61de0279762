"""The workload model: correlated, heavy-tailed, capped lengths; exact trace replay; trace
errors that name file, row and field."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from staleflow.sim import (
    ClusterConfig,
    SimCluster,
    SyntheticWorkload,
    TraceError,
    TraceWorkload,
    WorkloadConfig,
    read_trace,
    tiny,
)


def _groups(n: int = 2000, members: int = 16, seed: int = 0) -> np.ndarray:
    w = SyntheticWorkload(WorkloadConfig(max_response=20_000), members, seed)
    return np.array([w.draw_group()[1] for _ in range(n)], dtype=np.float64)


def test_lengths_are_correlated_within_groups() -> None:
    lengths = np.log(_groups())
    within = lengths.var(axis=1, ddof=1).mean()
    between = lengths.mean(axis=1).var(ddof=1) - within / lengths.shape[1]
    icc = between / (between + within)
    assert icc > 0.7, icc
    # two members of the same group, paired across groups
    r = np.corrcoef(lengths[:, 0], lengths[:, 1])[0, 1]
    assert r > 0.7, r


def test_cap_makes_a_point_mass_and_a_long_tail() -> None:
    lengths = _groups()
    at_cap = (lengths == 20_000).mean()
    assert 0.02 < at_cap < 0.2, at_cap
    assert lengths.max() == 20_000
    assert np.median(lengths) < lengths.mean()  # right-skewed
    assert np.percentile(lengths, 2.5) < 1_500  # spans from hundreds of tokens


def test_synthetic_is_deterministic_for_a_seed() -> None:
    assert np.array_equal(_groups(50, seed=4), _groups(50, seed=4))
    assert not np.array_equal(_groups(50, seed=4), _groups(50, seed=5))


def test_prompt_lengths_respect_the_cap() -> None:
    w = SyntheticWorkload(WorkloadConfig(max_prompt=300, prompt_median=200), 4, 0)
    prompts = [w.draw_group()[0] for _ in range(500)]
    assert max(prompts) <= 300 and min(prompts) >= 1


def _trace_rows() -> list[dict[str, object]]:
    rng = np.random.default_rng(0)
    return [
        {
            "prompt_len": int(rng.integers(20, 100)),
            "response_lengths": [int(x) for x in rng.integers(50, 1500, 4)],
        }
        for _ in range(40)
    ]


def test_trace_replays_exactly(tmp_path: Path) -> None:
    rows = _trace_rows()
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    workload = TraceWorkload.from_file(path, members=4, cycle=False)
    config = tiny(eta=1, steps=3).with_(workload=WorkloadConfig(max_response=2_000))
    cluster = SimCluster(config, workload)
    cluster.run()
    assert cluster.check() == []
    assert len(cluster.trained) >= 3 * 4
    for sample_id, prompt_len, lengths in cluster.trained:
        row = rows[sample_id]
        assert prompt_len == row["prompt_len"]
        assert sorted(lengths) == sorted(row["response_lengths"])  # type: ignore[type-var]


def test_csv_trace_reads(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("prompt_len,response_lengths\n10,5 6 7\n12,8;9\n")
    groups = read_trace(path)
    assert [g.response_lengths for g in groups] == [(5, 6, 7), (8, 9)]
    assert [g.prompt_len for g in groups] == [10, 12]


@pytest.mark.parametrize(
    ("text", "suffix", "match"),
    [
        (
            '{"prompt_len": 5, "response_lengths": [1, 2]}\n{"prompt_len": 5}\n',
            ".jsonl",
            r"t\.jsonl: row 2: field 'response_lengths' is missing",
        ),
        (
            '{"prompt_len": -3, "response_lengths": [1]}\n',
            ".jsonl",
            r"row 1: field 'prompt_len' must be a positive integer",
        ),
        (
            '{"prompt_len": 4, "response_lengths": [1, "x"]}\n',
            ".jsonl",
            r"row 1: field 'response_lengths' must be a positive integer, got 'x'",
        ),
        ("{not json\n", ".jsonl", r"row 1: not valid JSON"),
        (
            "prompt_len,response_lengths\n10,5 6\n7,\n",
            ".csv",
            r"t\.csv: row 2: field 'response_lengths' is missing",
        ),
        (
            "prompt_len,response_lengths\nabc,5\n",
            ".csv",
            r"row 1: field 'prompt_len' must be a positive integer, got 'abc'",
        ),
        ("prompt_len\n10\n", ".csv", r"row 0 \(header\): missing field"),
        ("", ".jsonl", "holds no groups"),
    ],
)
def test_malformed_trace_rows_name_file_row_field(
    tmp_path: Path, text: str, suffix: str, match: str
) -> None:
    path = tmp_path / f"t{suffix}"
    path.write_text(text)
    with pytest.raises(TraceError, match=match):
        read_trace(path)


def test_missing_trace_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such trace file"):
        read_trace(tmp_path / "absent.jsonl")


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        WorkloadConfig(group_median_frac=0.0)
    with pytest.raises(ValueError):
        ClusterConfig(instances=0)


# -- the shapes of the experiment matrix ----------------------------------------------------


def test_the_default_stream_is_unchanged_by_the_new_shapes() -> None:
    """Turning nothing on draws exactly what the model drew before the shapes existed."""
    a = SyntheticWorkload(WorkloadConfig(max_response=20_000), 16, 5)
    b = SyntheticWorkload(WorkloadConfig(max_response=20_000, long_median_frac=0.9), 16, 5)
    for _ in range(50):
        pa, la = a.draw_group()
        pb, lb = b.draw_group()
        assert pa == pb and (la == lb).all()


def test_bimodal_groups_are_either_long_or_short() -> None:
    cfg = WorkloadConfig(
        max_response=20_000,
        group_median_frac=0.05,
        group_sigma=0.5,
        long_frac=0.3,
        long_median_frac=0.6,
        long_sigma=0.3,
    )
    w = SyntheticWorkload(cfg, 16, 0)
    medians = np.array([np.median(w.draw_group()[1]) for _ in range(3_000)])
    long = medians > 5_000  # between the modes (1K and 12K)
    assert long.mean() == pytest.approx(0.3, abs=0.03)
    assert np.median(medians[long]) == pytest.approx(12_000, rel=0.1)
    assert np.median(medians[~long]) == pytest.approx(1_000, rel=0.15)


def test_outliers_run_to_the_cap_one_member_at_a_time() -> None:
    cfg = WorkloadConfig(
        max_response=20_000, group_median_frac=0.02, group_sigma=0.1, outlier_prob=1 / 16
    )
    w = SyntheticWorkload(cfg, 16, 1)
    groups = np.array([w.draw_group()[1] for _ in range(2_000)])
    at_cap = groups == 20_000
    assert at_cap.mean() == pytest.approx(1 / 16, abs=0.01)
    # the rest of an outlier's group stays short
    with_outlier = at_cap.any(axis=1)
    assert np.median(groups[with_outlier][~at_cap[with_outlier]]) < 1_000


def test_shape_parameters_are_validated() -> None:
    with pytest.raises(ValueError, match="long_frac"):
        WorkloadConfig(long_frac=1.5)
    with pytest.raises(ValueError, match="outlier_frac"):
        WorkloadConfig(outlier_frac=0.0)
