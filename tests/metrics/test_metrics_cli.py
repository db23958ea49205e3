"""`asyncflow report <output_dir>`, run in-process."""
from __future__ import annotations

from _metrics_run import png_size, write_run

from asyncflow.cli import main


def test_report_command_writes_and_prints_the_paths(tmp_path, capsys):
    write_run(tmp_path, steps=20, warmup_steps=2)
    with (tmp_path / "timeline.jsonl").open("a") as f:
        f.write('{"lane": "rank0 actor", "stage": "upd')  # the run crashed mid-line
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    report_dir = tmp_path / "report"
    assert str(report_dir) in out
    for name in ("training_curves.png", "throughput.png", "timeline.png", "trace.json"):
        assert str(report_dir / name) in out
        assert (report_dir / name).stat().st_size > 0
    png_size(report_dir / "timeline.png")


def test_missing_dir_or_metrics_exit_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "asyncflow report: error:" in err and "missing does not exist" in err
    assert main(["report", str(tmp_path)]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err
    assert not (tmp_path / "report").exists()


def test_corrupt_metrics_exit_1_naming_the_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    assert main(["report", str(tmp_path)]) == 1
    assert "metrics.jsonl:2: not valid JSON" in capsys.readouterr().err
