"""The simulator's compute model (sim/compute.py) and `kvproof sim calibrate`: the file's
round trip, the interpolation and extrapolation rule, a scenario naming a compute model
file (relative paths, replays without the file), bad files, and the calibrate command on a
tiny model with a tiny grid."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sim.compute import (CalibratedCompute, CalibratedTables, SerialLoop, interpolate,
                         interpolate2, read_compute_file, write_compute_file)
from sim.scenario import ScenarioError, load_scenario, scenario_from_dict

TABLES = {
    "format": "kvproof-compute/1", "first_token": "prefill",
    "measured": {"model": "made-up", "threads": 1},
    "prefill": {"chunk_tokens": [64, 128], "prompt_tokens": [32, 64, 128],
                "seconds": [[0.010, 0.020, 0.040], [0.012, 0.022, 0.038]]},
    "decode": {"batch_size": [1, 4], "context_tokens": [32, 96],
               "step_seconds": [[0.001, 0.002], [0.004, 0.008]]},
    "transport": {"in-process": {"page_tokens": 16, "page_bytes": 2048,
                                 "write_seconds": 0.0005}},
}


def write_tables(path: Path, **changes) -> Path:
    data = json.loads(json.dumps(TABLES))
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            data[section][field] = value
        else:
            data[section] = value
    write_compute_file(path, CalibratedTables.model_validate(data))
    return path


def test_the_compute_file_round_trips(tmp_path):
    path = write_tables(tmp_path / "c.toml")
    back = read_compute_file(path)
    assert back.source == str(path.resolve())
    assert back.model_dump(exclude={"source"}) == CalibratedTables.model_validate(
        TABLES).model_dump(exclude={"source"})


def test_interpolation_inside_below_and_above_the_grid():
    xs, ys = (1, 3, 5), (10.0, 30.0, 40.0)
    assert interpolate(xs, ys, 2) == 20.0          # linear inside
    assert interpolate(xs, ys, 0.5) == 10.0        # below: the first value
    assert interpolate(xs, ys, 9) == 60.0          # above: the last segment, 5/token
    assert interpolate(xs, (10.0, 30.0, 20.0), 9) == 20.0  # a falling last segment: flat
    assert interpolate(xs, ys, 9, extend=False) == 40.0
    # bilinear: rows 1 and 4 at context 64 are 0.0015 and 0.006; batch 2 is a third along
    assert interpolate2((1, 4), (32, 96), ((0.001, 0.002), (0.004, 0.008)), 2, 64) == \
        pytest.approx(0.0015 + (0.006 - 0.0015) / 3)


def test_the_calibrated_model_reads_its_tables():
    scenario = scenario_from_dict({"compute": {"tables": TABLES, "prefill_chunk_tokens": 64,
                                               "transport": "in-process"},
                                   "cluster": {"page_tokens": 32}})
    model = CalibratedCompute(scenario.compute.tables, scenario.compute, scenario.link, 32)
    assert model.prefill_s(48) == pytest.approx(0.015)
    assert model.prefill_s(256) == pytest.approx(0.040 + 128 * 0.020 / 64)
    # a chunk above the grid reads the largest chunk measured, never extrapolates
    wide = scenario.with_options(compute={**scenario.compute.model_dump(),
                                          "prefill_chunk_tokens": 4096})
    assert CalibratedCompute(wide.compute.tables, wide.compute, wide.link,
                             32).prefill_s(64) == pytest.approx(0.022)
    # the mean context: 2 sequences of 64 tokens each
    assert model.decode_step_s(2, 128) == pytest.approx(0.0015 + (0.006 - 0.0015) / 3)
    assert model.page_write_s == pytest.approx(0.001)  # 0.5 ms per 16 tokens, pages of 32
    assert model.first_token_at_prefill


def test_serial_workers_take_turns():
    loop = SerialLoop()
    assert loop.occupy(0.0, 1.0) == 1.0
    assert loop.occupy(0.5, 1.0) == 1.5   # waits for the first to end at 1.0
    assert loop.occupy(3.0, 0.25) == 0.25  # idle by then
    assert loop.wait_s(3.0) == 0.25 and loop.wait_s(4.0) == 0.0  # a message: after it


def one_request_scenario(folder: Path, model: str, **compute) -> Path:
    (folder / "trace.jsonl").write_text(json.dumps(
        {"arrival_s": 0.0, "prompt_tokens": 64, "output_tokens": 3}) + "\n")
    text = f"""name = "calibrated-one"
requests = 1
[cluster]
prefill_workers = 1
decode_workers = 1
page_tokens = 16
prefill_pool_tokens = 1024
decode_pool_tokens = 1024
context_tokens = 512
[workload]
arrival = "trace"
trace_file = "{folder / 'trace.jsonl'}"
[link]
message_latency_s = 0.0
write_latency_s = 0.0
writes_in_flight_max = 1
[compute]
model = "{model}"
prefill_chunk_tokens = 64
""" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in compute.items())
    path = folder / "scenario.toml"
    path.write_text(text)
    return path


def test_a_scenario_names_a_compute_file_relative_to_itself(tmp_path, monkeypatch):
    from sim.run import simulate

    write_tables(tmp_path / "compute.toml")
    scenario = load_scenario(str(one_request_scenario(tmp_path, "compute.toml",
                                                      transport="in-process")))
    assert scenario.compute.model == str((tmp_path / "compute.toml").resolve())
    monkeypatch.chdir(Path(__file__).parent)  # elsewhere: the dumped scenario keeps its tables
    again = scenario.with_options(seed=2)
    assert again.compute.tables == scenario.compute.tables
    result, sim = simulate(scenario)
    metrics = sim.folder.metrics
    # TTFT: the 64-token prompt's prefill (20 ms at chunks of 64), then its 4 pages one
    # after another on the NIC (0.5 ms each); the first token was sampled at the prefill.
    # The other two tokens are two decode steps of one 64-token and then 65-token sequence.
    assert metrics.ttft_s == [pytest.approx(0.020 + 4 * 0.0005)]
    step = [0.001 + 0.001 * (64 - 32) / 64, 0.001 + 0.001 * (65 - 32) / 64]
    assert metrics.e2e_s == [pytest.approx(0.022 + sum(step))]
    assert result["summary"]["outcomes"] == {"Ok": 1}


def test_the_log_replays_without_the_compute_file(tmp_path):
    from sim.run import replay_result, simulate

    write_tables(tmp_path / "compute.toml")
    scenario = load_scenario(str(one_request_scenario(tmp_path, "compute.toml")))
    log = tmp_path / "run.ndjson"
    simulate(scenario, log_path=str(log))
    (tmp_path / "compute.toml").unlink()
    result, folder = replay_result(str(log))
    assert folder.metrics.ttft_s == [pytest.approx(0.020 + 64 * 40960 / 25e9)]
    assert result["summary"]["outcomes"] == {"Ok": 1}


@pytest.mark.parametrize("content, message", [
    (None, "no such file (write one with kvproof sim calibrate"),
    ("format = \n", "not valid TOML"),
    ('format = "kvproof-compute/0"\n', "format is 'kvproof-compute/0', not 'kvproof-compute/1'"),
    ("rows", "decode.step_seconds must be 2 rows of 2"),
    ("order", "prefill.prompt_tokens must be strictly increasing, got [64, 32, 128]"),
    ("negative", "seconds must be finite and >= 0"),
])
def test_a_bad_compute_file_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "compute.toml"
    if content == "rows":
        write_tables(path)
        path.write_text(path.read_text().replace("  [0.004, 0.008],\n", ""))
    elif content == "order":
        write_tables(path)
        path.write_text(path.read_text().replace("[32, 64, 128]", "[64, 32, 128]"))
    elif content == "negative":
        write_tables(path)
        path.write_text(path.read_text().replace("0.001, 0.002", "-0.001, 0.002"))
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ScenarioError) as error:
        load_scenario(str(one_request_scenario(tmp_path, "compute.toml")))
    assert message in str(error.value)
    assert str(path) in str(error.value)


def test_a_transport_the_file_did_not_measure_is_refused(tmp_path):
    write_tables(tmp_path / "compute.toml")
    with pytest.raises(ScenarioError, match="transport 'rdma' was not measured in .*; it "
                                            "has: in-process"):
        load_scenario(str(one_request_scenario(tmp_path, "compute.toml", transport="rdma")))
    with pytest.raises(ScenarioError, match="give compute.model"):
        scenario_from_dict({"compute": {"transport": "in-process"}})


# -- kvproof sim calibrate ------------------------------------------------------------------------

def tiny_model_folder(folder: Path) -> Path:
    """A random one-layer Llama as an HF folder, written without transformers (fast):
    hidden 32, 2 heads of 16, 1 KV head; a K|V page of 16 tokens is 16 x 2 x 16 x 4 bytes."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, generator=generator) * 0.1
    p = "model.layers.0."
    save_file({"model.embed_tokens.weight": w(64, 32), "model.norm.weight": torch.ones(32),
               p + "input_layernorm.weight": torch.ones(32),
               p + "post_attention_layernorm.weight": torch.ones(32),
               p + "self_attn.q_proj.weight": w(32, 32), p + "self_attn.k_proj.weight": w(16, 32),
               p + "self_attn.v_proj.weight": w(16, 32), p + "self_attn.o_proj.weight": w(32, 32),
               p + "mlp.gate_proj.weight": w(48, 32), p + "mlp.up_proj.weight": w(48, 32),
               p + "mlp.down_proj.weight": w(32, 48)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=48, vocab_size=64, rms_norm_eps=1e-6,
        max_position_embeddings=1024, tie_word_embeddings=True, hidden_act="silu")))
    return folder


TINY_GRID = ["--prompt-tokens", "16,48", "--chunk-tokens", "32", "--batch-sizes", "1,3",
             "--context-tokens", "8,40", "--repeats", "1", "--threads", "1"]


def test_calibrate_measures_the_grid_and_a_scenario_runs_on_it(tmp_path, capsys):
    from api.cli import main

    model = tiny_model_folder(tmp_path / "tiny")
    out = tmp_path / "tiny.toml"
    assert main(["sim", "calibrate", "--model", str(model), "--out", str(out)]
                + TINY_GRID) == 0
    printed = capsys.readouterr().out
    assert "7/7  pass 1/1  page write (in-process, 16 tokens, 32 pages)" in printed
    tables = read_compute_file(out)
    assert tables.prefill.chunk_tokens == (32,) and tables.prefill.prompt_tokens == (16, 48)
    assert tables.decode.batch_size == (1, 3) and tables.decode.context_tokens == (8, 40)
    assert all(s > 0 for row in tables.prefill.seconds + tables.decode.step_seconds
               for s in row)
    assert tables.transport["in-process"].page_bytes == 16 * 2 * 16 * 4
    assert tables.measured["model"] == "tiny" and tables.measured["torch_threads"] == 1
    scenario = load_scenario(str(one_request_scenario(tmp_path, "tiny.toml",
                                                      transport="in-process")))
    from sim.run import simulate
    result, _ = simulate(scenario)
    assert result["summary"]["outcomes"] == {"Ok": 1}


def test_calibrate_refuses_bad_options_and_writes_nothing_over_its_bound(tmp_path, capsys):
    from api.cli import main

    out = tmp_path / "never.toml"
    assert main(["sim", "calibrate", "--out", str(out), "--batch-sizes", "4"]) == 2
    assert "--batch-sizes: give at least two grid points" in capsys.readouterr().err
    assert main(["sim", "calibrate", "--out", str(tmp_path / "no" / "x.toml")]) == 2
    assert "--out" in capsys.readouterr().err
    model = tiny_model_folder(tmp_path / "tiny")
    assert main(["sim", "calibrate", "--model", str(model), "--out", str(out),
                 "--seconds-max", "1e-9", "--quiet"] + TINY_GRID) == 2
    err = capsys.readouterr().err
    assert "measurements, stopped before" in err and "raise the time bound" in err
    assert not out.exists()
    assert not os.path.exists(str(tmp_path / "no"))


def test_serial_workers_share_one_loop_in_a_run(tmp_path):
    """Two prompts at once on two prefill workers: in parallel each is first-token ready at
    20 ms + 4 page writes; on one loop the second computes after the first (20..40 ms), and
    the first's final word waits for that computation (taken at 40 ms)."""
    from sim.run import simulate

    write_tables(tmp_path / "compute.toml")
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps(
        {"arrival_s": 0.0, "prompt_tokens": 64, "output_tokens": 2}) + "\n" for _ in range(2)))
    base = {"requests": 2, "cluster": {"prefill_workers": 2, "decode_workers": 1,
                                       "page_tokens": 16, "prefill_pool_tokens": 1024,
                                       "decode_pool_tokens": 1024, "context_tokens": 512},
            "workload": {"arrival": "trace", "trace_file": str(tmp_path / "trace.jsonl")},
            "link": {"message_latency_s": 0.0, "write_latency_s": 0.0},
            "compute": {"model": "compute.toml", "transport": "in-process",
                        "prefill_chunk_tokens": 64}}
    ttft = {}
    for serial in (False, True):
        data = json.loads(json.dumps(base))
        data["compute"]["serial_workers"] = serial
        _, sim = simulate(scenario_from_dict(data, base_dir=tmp_path))
        ttft[serial] = sorted(sim.folder.metrics.ttft_s)
    assert ttft[False] == [pytest.approx(0.022)] * 2
    assert ttft[True] == [pytest.approx(0.040), pytest.approx(0.042)]
