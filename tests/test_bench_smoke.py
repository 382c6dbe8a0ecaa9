"""The GPU benchmarks' control flow, run in their --smoke mode on CPU: every table, option and JSON field."""

from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import ranks

BENCH = Path(__file__).resolve().parent.parent / "bench"


@dataclass
class BenchRun:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def run_bench(monkeypatch, capsys):
    """Runs a bench script's main() in this process, as ``python bench/<script> [--smoke] args`` would: its exit status
    and what it printed. The scripts' ranks are forked from the tests' rank server, which has torch, pipecomm and
    transformers imported, instead of a new interpreter per script importing them twice (7 s of CPU each)."""
    monkeypatch.syspath_prepend(str(BENCH))
    ranks.start_rank_server()  # before a script names its own preloads, which would then apply to every later test
    environment, threads = dict(os.environ), torch.get_num_threads()

    def run(script: str, *args: str, smoke: bool = True) -> BenchRun:
        module = importlib.import_module(script.removesuffix(".py"))
        monkeypatch.setattr(sys, "argv", [str(BENCH / script), *(["--smoke"] if smoke else []), *args])
        try:
            module.main()
            returncode = 0
        except SystemExit as exit:  # as the interpreter reports it: a message goes to standard error with status 1
            if isinstance(exit.code, str):
                print(exit.code, file=sys.stderr)
            returncode = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
        finally:
            os.environ.clear()
            os.environ.update(environment)
            torch.set_num_threads(threads)
        captured = capsys.readouterr()
        return BenchRun(returncode, captured.out, captured.err)

    return run


def test_p2p_smoke_measures_every_phase(tmp_path, run_bench):
    result = run_bench("p2p.py", "--json", str(tmp_path / "p2p.json"), "--profile", str(tmp_path / "profile"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "p2p.json").read_text())
    for row in report["p2p"]:
        assert row["pc_us"] > 0 and row["pc_host_us"] > 0 and row["nccl_host_us"] > 0, row
    assert {row["role"] for row in report["gemm"]} == {"sender", "receiver"}
    assert all(row["pc_loss%"] is not None and row["nccl_loss%"] is not None for row in report["gemm"])
    for rank in (0, 1):
        assert "pipecomm.recv" in (tmp_path / "profile" / f"pingpong-rank{rank}.txt").read_text()


def test_e2e_smoke_sweeps_micro_batch_counts(tmp_path, run_bench):
    result = run_bench("e2e.py", "--configs", "compute", "--micro-batches", "2,4", "--schedules",
                       "1f1b,zb-h1,torch 1F1B", "--json", str(tmp_path / "e2e.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "e2e.json").read_text())
    assert set(report["rows"]) == {"compute-m2", "compute-m4"}
    for name, count in (("compute-m2", 2), ("compute-m4", 4)):
        assert report["configs"][name]["shape"]["micro_batches"] == count
        rows = report["rows"][name]
        assert [row["schedule"] for row in rows] == ["1f1b", "zb-h1", "torch 1F1B"]
        assert all("error" not in row and row["step_ms"] > 0 for row in rows), rows
        assert max(row["loss"] for row in rows) == pytest.approx(min(row["loss"] for row in rows), rel=1e-5)


def test_e2e_smoke_runs_the_v_zero_bubble_and_auto_rows(tmp_path, run_bench):
    # 4 micro-batches: DualPipeV needs as many as stages (2 x 2 ranks in the V).
    schedules = ["zb-v", "zb-h2", "auto", "torch 1F1B", "torch ZBVZeroBubble", "torch DualPipeV"]
    result = run_bench("e2e.py", "--configs", "compute", "--micro-batches", "4", "--steps", "1", "--warmup", "0",
                       "--schedules", ",".join(schedules), "--json", str(tmp_path / "e2e.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "e2e.json").read_text())
    rows = {row["schedule"]: row for row in report["rows"]["compute-m4"]}
    assert list(rows) == schedules
    assert all("error" not in row and row["step_ms"] > 0 for row in rows.values()), rows
    losses = [row["loss"] for row in rows.values()]
    assert max(losses) == pytest.approx(min(losses), rel=1e-5)
    auto = rows["auto"]
    assert auto["planned_schedule"] and set(auto["planned_costs_ms"]) == {"F", "I", "W"}
    assert 0 <= auto["theory"] < 1 and 0 <= rows["zb-v"]["theory"] < rows["torch 1F1B"]["theory"]
    tried = [name for name, _ in auto["auto_step_times_ms"]]
    assert tried[0] == "zb-h1" and auto["planned_schedule"] in tried, tried
    assert f"kept {auto['planned_schedule']} (theory" in result.stdout
    goals = {goal["target"]: goal for goal in report["targets"]}
    assert goals["compute-m4: same name: pipecomm zb-v faster than torch ZBVZeroBubble"]["verdict"] in ("PASS", "FAIL")
    assert any(target.startswith("compute: best pipecomm schedule at <= torch 1F1B's peak memory") for target in goals)


def test_e2e_smoke_runs_the_llama_config_against_the_one_process_loss(tmp_path, run_bench):
    # A looped and a V layout from each library: token ids into the first stage, logits out of the last.
    schedules = ["1f1b", "zb-v", "torch 1F1B", "torch ZBVZeroBubble"]
    result = run_bench("e2e.py", "--configs", "llama", "--steps", "1", "--warmup", "0",
                       "--schedules", ",".join(schedules), "--json", str(tmp_path / "e2e.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "e2e.json").read_text())
    llama = report["configs"]["llama"]
    assert llama["shape"]["model"] == "llama" and llama["shape"]["vocab"] == 128
    rows = report["rows"]["llama"]
    assert [row["schedule"] for row in rows] == schedules
    assert all("error" not in row and row["step_ms"] > 0 for row in rows), rows
    assert llama["reference_spread"] <= 1e-4
    assert all(row["loss"] == pytest.approx(llama["reference_loss"], rel=1e-4) for row in rows)


def test_e2e_memory_bound_target_leaves_zb_h2_apart(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import e2e

    def row(schedule, speed, memory):
        return {"schedule": schedule, "step_ms": 100 / speed, "speed_vs_torch_1f1b": speed, "mem/torch_1f1b": memory}

    rows = {"compute": [row("torch 1F1B", 1.0, 1.0), row("1f1b", 1.1, 0.8), row("zb-v", 1.4, 1.0),
                        row("zb-h2", 1.6, 1.7), row("auto", 1.5, 1.05), row("torch ZBVZeroBubble", 1.2, 1.0)]}
    goals = {goal["target"].split(" >= ")[0]: goal for goal in e2e.targets(rows, ranks=4)}
    bound = goals["compute: best pipecomm schedule at <= torch 1F1B's peak memory (largest rank's; zb-h2 apart)"]
    assert bound["target"].endswith(">= 1.35x torch 1F1B step speed at p = 4")
    assert bound["value"].startswith("zb-v speed 1.400x") and bound["verdict"] == "PASS"
    assert goals["compute: best pipecomm schedule"]["value"] == "zb-h2 1.600x"
    zb_h2 = next(goal for goal in goals.values() if goal["verdict"] == "info")
    assert zb_h2["value"] == "speed 1.600x, memory 1.700x"
    assert goals["compute: same name: pipecomm 1f1b faster than torch 1F1B"]["verdict"] == "PASS"
    assert goals["compute: same name: pipecomm zb-v faster than torch ZBVZeroBubble"]["value"].endswith("1.167x")


def test_host_split_smoke_times_send_and_recv_apart(tmp_path, run_bench):
    result = run_bench("host_split.py", "--rounds", "4", "--per-round", "8", "--json", str(tmp_path / "split.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "split.json").read_text())
    rows = report["rows"]
    assert [row["message"] for row in rows] == ["1 x 4 KB", "8 x 8 KB"]
    assert all(row["send_us"] > 0 and row["recv_us"] > 0 for row in rows), rows
    ping = report["ping_pong"]
    assert [row["message"] for row in ping] == ["1 x 4 KB", "8 x 8 KB"]
    assert all(value > 0 for row in ping for key, value in row.items() if key != "message"), ping


@pytest.mark.parametrize("counts", ["1,8", "8,x"])
def test_e2e_rejects_bad_micro_batch_counts(counts, run_bench):
    result = run_bench("e2e.py", "--micro-batches", counts)
    assert result.returncode == 2 and "--micro-batches" in result.stderr, result.stderr[-2000:]


def test_capture_overhead_smoke_times_both_stages(tmp_path, run_bench):
    result = run_bench("capture_overhead.py", "--json", str(tmp_path / "capture.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "capture.json").read_text())["rows"]
    assert [row["stage"] for row in rows] == ["captured", "by hand"] and all(row["fwd+bwd ms"] > 0 for row in rows)


def test_schedules_table_covers_every_schedule_and_case(tmp_path, run_bench):
    out = tmp_path / "schedules.json"
    result = run_bench("schedules.py", "--costs", "1,1,1", "--json", str(out), smoke=False)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["p"], row["m"]) for row in rows] == [(2, 8), (4, 8), (8, 16), (4, 16), (8, 32)]
    for row in rows:
        assert row["zb-v mem"] <= row["1f1b mem"] == row["p"]
        assert row["zb-v"] > row["zb-h1"] > row["1f1b"], row
    assert "| p, m | gpipe | 1f1b | interleaved-1f1b | zb-h1 | zb-h2 | zb-v | plan 1x | plan 2x |" in result.stdout
    for row in rows:
        assert row["plan 1x"] >= max(row[name] for name in ("1f1b", "zb-h1", "zb-v")) - 1e-9, row


def test_stage_costs_measures_f_i_w_and_tabulates(tmp_path, run_bench):
    out = tmp_path / "costs.json"
    result = run_bench("stage_costs.py", "--cpu", "--steps", "1", "--configs", "overhead", "--json", str(out),
                       smoke=False)
    assert result.returncode == 0, result.stderr[-3000:]
    overhead = json.loads(out.read_text())["configs"]["overhead"]
    assert all(overhead["costs_ms"][kind] > 0 for kind in ("F", "I", "W"))
    assert len(overhead["simulated"]) == 5 and "# overhead: one stage (4 layers)" in result.stdout


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_recompute_memory_smoke_keeps_less_with_recomputation_and_offloads(tmp_path, model, run_bench):
    result = run_bench("recompute_memory.py", "--model", model, "--stages", "4", "--warmup", "1", "--rounds", "1",
                       "--json", str(tmp_path / "recompute.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "recompute.json").read_text())
    assert report["model"] == model and f"# compute, {model} (" in result.stdout
    rows = {row["mode"]: row for row in report["rows"]}
    assert rows["stage"]["kept_MiB"] < rows["layers"]["kept_MiB"] < rows["none"]["kept_MiB"]
    # At p = 4 the first stage holds 4 micro-batches at its peak, and waits long enough for copies that lower it (at
    # p = 2 the plan finds none that would: the backward of one runs while the other waits).
    assert rows["offload"]["offloaded"] > 0 and rows["offload+stage"]["offloaded"] > 0 and rows["none"]["offloaded"] == 0


def test_inference_smoke_compares_with_torch_and_agrees(tmp_path, run_bench):
    result = run_bench("inference.py", "--json", str(tmp_path / "inference.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["placement"]: row for row in json.loads((tmp_path / "inference.json").read_text())["rows"]}
    assert set(rows) == {"looped", "interleaved", "v"}
    assert all(row["pipecomm_ms"] > 0 and row["outputs_agree"] for row in rows.values())
    assert rows["looped"]["torch_ms"] > 0 and rows["interleaved"]["torch_ms"] > 0 and rows["v"]["torch_ms"] is None


@pytest.mark.parametrize("composition", ["fsdp", "tp"])
def test_parallel_3d_smoke_engines_agree_on_the_loss(tmp_path, composition, run_bench):
    result = run_bench("parallel_3d.py", "--composition", composition, "--json", str(tmp_path / "3d.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "3d.json").read_text())
    rows = {row["engine"]: row for row in report["rows"]}
    assert set(rows) == {"pipecomm", "torch"}
    assert all("error" not in row and row["tokens_per_s"] > 0 for row in rows.values()), rows
    assert rows["pipecomm"]["loss_step1"] == pytest.approx(rows["torch"]["loss_step1"], rel=1e-4)
    assert report["ratios"]["loss_step1_rel_diff"] <= 1e-4


def test_host_cost_smoke_meters_every_action_of_both_libraries(tmp_path, run_bench):
    result = run_bench("host_cost.py", "--models", "mha,llama", "--json", str(tmp_path / "host.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "host.json").read_text())
    for model in ("mha", "llama"):
        rows = {row["runner"]: row for row in report["tables"][model]}
        assert list(rows) == ["torch 1F1B", "pipecomm 1f1b", "pipecomm 1f1b eager", "pipecomm zb-h1"]
        assert rows["torch 1F1B"]["vs_torch"] == 1.0
        for name, row in rows.items():
            assert row["thread_us"] > 0 and row["F"] > 0 and row["loss"] > 0 and row["send"] > 0, (model, name)
        assert rows["pipecomm zb-h1"]["I"] > 0 and rows["pipecomm zb-h1"]["W"] > 0 and rows["pipecomm 1f1b"]["I"] is None
        assert rows["torch 1F1B"]["p2p"] > 0 and rows["pipecomm 1f1b"]["p2p"] is None
    # Each rank's calls of one step: m forwards and m backwards of its stage, m sends and receives.
    for rank_row in report["ranks"]:
        calls = rank_row["calls_per_step"]
        assert calls["F"] == 8 and calls.get("B", calls.get("I")) == 8, rank_row
    assert "mha:" in result.stdout and "pipecomm zb-h1" in result.stdout


def test_host_cost_tiny_stage_per_micro_batch_count_against_the_stage_alone(tmp_path, run_bench):
    result = run_bench("host_cost.py", "--models", "tiny", "--micro-batches", "2,4",
                       "--rows", "torch 1F1B,pipecomm 1f1b,stage alone", "--json", str(tmp_path / "tiny.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "tiny.json").read_text())
    assert list(report["tables"]) == ["tiny m=2", "tiny m=4"]
    for name, micro_batches in (("tiny m=2", 2), ("tiny m=4", 4)):
        rows = {row["runner"]: row for row in report["tables"][name]}
        assert list(rows) == ["torch 1F1B", "pipecomm 1f1b", "stage alone"]
        assert rows["torch 1F1B"]["wall_vs_torch"] == 1.0 and rows["pipecomm 1f1b"]["wall_vs_torch"] > 0
        assert rows["stage alone"]["F"] > 0 and rows["stage alone"]["B"] > 0 and rows["stage alone"]["send"] is None
        for rank_row in report["ranks"]:
            if rank_row["table"] == name:
                assert rank_row["calls_per_step"]["F"] == micro_batches, rank_row
