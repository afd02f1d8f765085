"""The GPU check and the demo stay runnable: dry runs on CPU, with assertions."""
import fill_bench
import gpu_check

import demo


def test_gpu_check_smoke_run_is_byte_exact(tmp_path, capsys):
    failures = gpu_check.main(["--smoke", "--out", str(tmp_path), "--device", "cpu"])
    assert failures == 0
    out = capsys.readouterr().out
    assert "208/208 cases byte-exact" in out
    assert (tmp_path / "gpu_check.json").exists()


def test_fill_bench_rows_compare_three_implementations():
    rows = fill_bench.run_case("cpu", fill_bytes=1 << 20, num_layers=2, num_requests=4, mode="normal", repeat=1)
    assert [r["impl"] for r in rows] == ["kvfill", "in-tree", "memset"]
    assert rows[0]["verified"] is True and rows[0]["MiB"] > 0


def test_demo_small_run_verifies(capsys):
    assert demo.main(["--requests", "2", "--prompt-len", "300", "--layers", "2"]) == 0
    assert "demo OK" in capsys.readouterr().out
