"""`kvproof generate` and `kvproof serve` refuse bad options in one line with exit status 2
before the model loads (the loader is replaced by one that fails the test), choose torch's
threads by a stated rule, apply --threads before the load, and list their own exit codes."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch

from api.cli import main
from tests.api_cases import tiny_chat_model  # noqa: F401

REFUSAL_S_MAX = 5  # loose: a refusal imports nothing heavy and reads no weights


@pytest.fixture
def no_model_load(monkeypatch):
    """The loader fails the test if called; torch's thread counts are restored after."""
    import engine.load

    def load_model(*args, **kwargs):
        pytest.fail("the model was loaded before the bad option was refused")

    monkeypatch.setattr(engine.load, "load_model", load_model)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad-models")
    (folder / "empty").mkdir()
    (folder / "config-only").mkdir()
    (folder / "config-only" / "config.json").write_text("{}")
    (folder / "text.gguf").write_text("not a model\n")
    return folder


@pytest.fixture
def port_in_use():
    holder = socket.create_server(("127.0.0.1", 0))
    yield holder.getsockname()[1]
    holder.close()


NO_CUDA = "cuda" if not torch.cuda.is_available() else None
BAD_ARGUMENTS = [  # (subcommand and arguments, fragment of the one line)
    ("serve --drain-s -5", "argument --drain-s: must be 0 or more, got -5"),
    ("serve --drain-s nan", "argument --drain-s: expected a finite number, got 'nan'"),
    ("serve --port 99999", "argument --port: must be a port from 0 to 65535, got 99999"),
    ("serve --port -1", "argument --port: must be a port from 0 to 65535, got -1"),
    ("serve --port http", "argument --port: expected a whole number, got 'http'"),
    ("serve --host 999.999.1.1", "--host 999.999.1.1: not an address of this machine"),
    ("serve --port {port_in_use}", "cannot listen on 127.0.0.1:{port_in_use}: Address "
                                   "already in use\n"),
    ("serve --host 10.255.1.1", "cannot listen on 10.255.1.1:8000: Cannot assign requested "
                                "address\n"),
    ("serve --device tpu", "device 'tpu': expected cpu, cuda or cuda:N"),
    ("serve --dtype int8", "argument --dtype: invalid choice: 'int8'"),
    ("serve --threads 0", "argument --threads: must be at least 1, got 0"),
    ("serve --threads 100000", "--threads 100000: this process may run on"),
    ("serve --model {models}/missing", "missing: no such file or folder"),
    ("serve --model {models}/empty", "empty: no config.json"),
    ("serve --model {models}/config-only", "config-only: no *.safetensors files"),
    ("serve --model {models}/text.gguf", "text.gguf: not a GGUF file"),
    ("generate ''", "prompt 1 is empty; give the text to complete"),
    ("generate hello ''", "prompt 2 is empty"),
    ("generate --device tpu hello", "device 'tpu': expected cpu, cuda or cuda:N"),
    ("generate --device cpu:1 hello", "device 'cpu:1': expected cpu, cuda or cuda:N"),
    ("generate --dtype int8 hello", "argument --dtype: invalid choice: 'int8'"),
    ("generate --threads -2 hello", "argument --threads: must be at least 1, got -2"),
    ("generate --temperature inf hello", "argument --temperature: expected a finite number"),
    ("generate --max-tokens 0 hello", "max_tokens"),
    ("generate --model {models}/missing hello", "missing: no such file or folder"),
    ("generate --model {models}/empty hello", "empty: no config.json"),
    ("sim one-pair --slo-ttft-ms -5", "argument --slo-ttft-ms: must be above 0, got -5"),
    ("sim one-pair --slo-tpot-ms 0", "argument --slo-tpot-ms: must be above 0, got 0"),
] + ([(f"serve --device {NO_CUDA}", "device 'cuda': this torch build sees no CUDA device"),
      (f"generate --device {NO_CUDA}:1 hello",
       "device 'cuda:1': this torch build sees no CUDA device")] if NO_CUDA else [])


def refusal(capsys, argv: list[str]) -> tuple[int, str]:
    """(exit status, stderr) of the CLI, whether the parser or the command refused."""
    try:
        code = main(argv)
    except SystemExit as stopped:
        code = stopped.code
    captured = capsys.readouterr()
    assert captured.out == ""
    return code, captured.err


@pytest.mark.parametrize("arguments, fragment", BAD_ARGUMENTS)
def test_a_bad_option_is_one_line_and_exit_2_before_the_model_loads(
        arguments, fragment, capsys, no_model_load, bad_models, port_in_use):
    import shlex

    values = dict(models=bad_models, port_in_use=port_in_use)
    argv = shlex.split(arguments.format(**values))
    started = time.monotonic()
    code, err = refusal(capsys, argv)
    assert time.monotonic() - started < REFUSAL_S_MAX
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(f"kvproof {argv[0]}: "), err
    assert fragment.format(**values) in err


def test_serve_releases_the_port_when_it_refuses_after_binding(capsys, no_model_load,
                                                               bad_models):
    """Refused after the bind (here: the loader raises), the port is free again."""
    import engine.load
    from engine.config import ModelFileError

    def load_model(*args, **kwargs):
        raise ModelFileError("refused at load")

    free = socket.create_server(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    engine.load.load_model = load_model  # no_model_load's monkeypatch undoes this
    code, err = refusal(capsys, ["serve", "--port", str(port)])
    assert (code, err) == (2, "kvproof serve: refused at load\n")
    socket.create_server(("127.0.0.1", port)).close()


# -- threads ---------------------------------------------------------------------------

@pytest.fixture
def restored_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_generate_threads_reach_torch_before_the_model_loads(
        tiny_chat_model, capsys, monkeypatch, restored_threads):  # noqa: F811
    """--threads 1 against a default of 2 (and torch at 2): torch has 1 thread when the
    loader runs, and the summary says so. (One thread: two on a busy machine are slow.)"""
    import engine.load
    from api import engine_options

    model = tiny_chat_model.path
    real_load, seen = engine.load.load_model, []

    def load_model(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real_load(*args, **kwargs)

    monkeypatch.setattr(engine.load, "load_model", load_model)
    monkeypatch.setattr(engine_options, "default_threads", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    capsys.readouterr()
    assert main(["generate", "--model", str(model), "--threads", "1", "--max-tokens", "2",
                 "hi"]) == 0
    assert seen == [1]
    assert "(float32, 1 torch thread)" in capsys.readouterr().out


def test_serve_threads_reach_torch_before_the_engine_is_built(restored_threads):
    import argparse

    from api.serve.command import _check, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for wanted in (1, 2) if len(os.sched_getaffinity(0)) > 1 else (1,):
        torch.set_num_threads(3 - wanted)
        _factory, _config, threads = _check(parser.parse_args(["--threads", str(wanted)]))
        assert threads == torch.get_num_threads() == wanted


def test_without_threads_omp_num_threads_is_honoured(monkeypatch, restored_threads):
    from api.engine_options import set_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)  # what torch read from it at start
    assert set_threads(None) == 1 == torch.get_num_threads()
    assert set_threads(1) == 1  # an explicit count wins over the environment


def test_the_default_is_the_idle_usable_cores(monkeypatch):
    from api import engine_options

    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(engine_options, "usable_cores", lambda: 4)
    # load average -> threads: the idle CPUs (8 less the load, rounded), capped at 4
    assert [engine_options.default_threads(load) for load in
            (0.0, 3.9, 4.5, 5.4, 6.6, 7.5, 8.0, 40.0)] == [4, 4, 4, 3, 1, 1, 1, 1]


def test_usable_cores_count_hyperthreads_once_and_obey_a_cgroup_quota(tmp_path):
    from api.engine_options import cgroup_cpu_quota, usable_cores

    assert cgroup_cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == 2
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == 1
    assert usable_cores(cgroup_root=tmp_path) == 1
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(v1) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    assert cgroup_cpu_quota(v1) == 3
    topology = "/sys/devices/system/cpu/cpu{}/topology/thread_siblings_list"
    if all(os.path.exists(topology.format(cpu)) for cpu in os.sched_getaffinity(0)):
        siblings = {open(topology.format(cpu)).read() for cpu in os.sched_getaffinity(0)}
        assert usable_cores(cgroup_root=tmp_path / "none") == len(siblings)


def test_the_dtype_choices_are_the_engines():
    from api.engine_options import DTYPE_NAMES
    from engine.model import DTYPES

    assert DTYPE_NAMES == tuple(DTYPES)


# -- exit codes in --help --------------------------------------------------------------

@pytest.mark.parametrize("command, first", [
    ("generate", "0  every prompt was completed"),
    ("serve", "0  stopped by SIGTERM or Ctrl-C"),
])
def test_generate_and_serve_list_their_own_exit_codes(command, first, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    codes = text.split("exit status:\n", 1)[1]
    assert "a property is violated" not in text
    assert [line.split()[0] for line in codes.splitlines() if line[:3].strip().isdigit()] == [
        "0", "2"]
    assert first in codes and "--threads N" in text


def test_the_protocol_subcommands_keep_the_verdict_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    assert "1  a property is violated" in capsys.readouterr().out
