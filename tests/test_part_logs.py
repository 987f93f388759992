"""One log per part of a split deployment, merged and validated (spec/partlog.py).

A lossy 2 x 2 simulator run with crashes (lossy-cluster, seed 1: 67 events, every loss
kind, a decode crash, resends) is replayed into a Split whose parts each log what they take;
the six logs (router, two prefills, two decodes, the environment), handed over in any
order and with their records scattered over other files, merge into one run that the spec
accepts with the single log's 67 steps. Forged logs are refused with the file and line of
the forged record: a step stamped before the message that caused it, the same moved
without its stamp's trace (only the spec can tell), a step dropped in the middle or at the
end, a step logged by a part that does not take it.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from spec import codec, core
from spec.check.simulate import behaviour
from spec.partlog import MergeError, PartLogs, flat_event, merge
from spec.tlaplus.runcheck import check_part_logs, check_run, placed
from sim.trace import log_run, read_part_logs, write_part_logs
from tests.cli_cases import run as cli
from tests.parts_cases import TWO_REQUESTS_LOSSY_2X2

STEPS = 67  # lossy-cluster seed 1 (tests/test_parts.py pins the same run)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> tuple[Path, Path]:
    """The simulator's single log, and a folder of the six part logs of the same run."""
    from sim.run import simulate
    from sim.scenario import load_scenario

    root = tmp_path_factory.mktemp("deployment")
    single = root / "run.ndjson"
    print("kvproof sim lossy-cluster --seed 1")
    simulate(load_scenario("lossy-cluster").model_copy(update={"seed": 1}),
             log_path=str(single))
    run = log_run(str(single))
    logs, where = PartLogs(run.model), {}
    for line, record in run.records:
        out = logs.take(flat_event(run.model, placed(run, line, record,
                                                     codec.decode(record)), where))
        assert type(out) is not core.Refusal, f"line {line}: {out}"
    parts = root / "parts"
    parts.mkdir()
    write_part_logs(logs, parts)
    return single, parts


def _files(parts: Path) -> list[Path]:
    return sorted(parts.glob("*.ndjson"))


def _merged(paths):
    m, logs = read_part_logs(paths)
    return merge(m, logs)


def test_the_part_logs_merge_into_a_run_of_the_spec(deployment):
    single, parts = deployment
    assert check_run(log_run(str(single))).steps == STEPS
    names = [p.name for p in _files(parts)]
    assert names == ["decode-0.ndjson", "decode-1.ndjson", "environment.ndjson",
                     "prefill-0.ndjson", "prefill-1.ndjson", "router.ndjson"]
    merged = _merged(_files(parts))
    assert merged.parts == {"router": 9, "prefill 0": 18, "prefill 1": 2, "decode 0": 14,
                            "decode 1": 12, "environment": 12}
    verdict = check_part_logs(merged)
    assert verdict.ok, verdict.message
    assert verdict.steps == STEPS
    # The same events as the single log, in an order of the merge's own.
    run = log_run(str(single))
    original = [json.dumps(codec.encode(placed(run, line, r, codec.decode(r))), sort_keys=True)
                for line, r in run.records]
    again = [json.dumps(codec.encode(codec.decode(r)), sort_keys=True) for r in merged.records]
    assert Counter(again) == Counter(original)


def test_the_merge_does_not_depend_on_files_or_their_order(deployment, tmp_path):
    _, parts = deployment
    seed = 29
    rng = random.Random(seed)
    print(f"shuffled with seed {seed}")
    head = _files(parts)[0].read_text().splitlines()[0]
    records = [line for path in _files(parts) for line in path.read_text().splitlines()[1:]]
    rng.shuffle(records)
    scattered = []
    for k in range(4):  # four files, each holding records of several parts in any order
        path = tmp_path / f"mixed-{k}.ndjson"
        path.write_text("\n".join([head, *records[k::4]]) + "\n")
        scattered.append(path)
    reference = _merged(_files(parts))
    for paths in (scattered, scattered[::-1], rng.sample(_files(parts), 6)):
        merged = _merged(paths)
        assert merged.records == reference.records
        assert check_part_logs(merged).steps == STEPS


def _forge(parts: Path, tmp_path: Path, edit) -> tuple[Path, dict]:
    """A copy of the logs with `edit` applied to {file name: list of records}; returns the
    folder and the records (line 1 is the header, so record i is at line i + 2)."""
    logs = {p.name: [json.loads(x) for x in p.read_text().splitlines()] for p in _files(parts)}
    edit(logs)
    out = tmp_path / "forged"
    out.mkdir()
    for name, lines in logs.items():
        (out / name).write_text("".join(json.dumps(x) + "\n" for x in lines))
    return out, logs


def _line(logs: dict, name: str, action: str, nth: int = 0) -> int:
    """The line of the nth record of `action` in file `name`."""
    found = [k for k, x in enumerate(logs[name], start=1) if x.get("a") == action]
    return found[nth]


def _refused(folder: Path) -> str:
    try:
        verdict = check_part_logs(_merged(_files(folder)))
    except MergeError as error:
        return str(error)
    assert not verdict.ok
    return verdict.message


def test_a_step_stamped_before_the_message_that_caused_it_is_refused(deployment, tmp_path):
    _, parts = deployment
    line = {}

    def edit(logs):
        line["k"] = _line(logs, "decode-1.ndjson", "Reserve")
        logs["decode-1.ndjson"][line["k"] - 1]["c"] = 1
    folder, logs = _forge(parts, tmp_path, edit)
    says = _refused(folder)
    assert says.startswith(f"{folder / 'decode-1.ndjson'} line {line['k']}: decode 1's step "
                           "1 (Reserve) is stamped 1, not after step 3 of router (Arrive"), says
    assert says.endswith("the step was moved before its cause"), says


def test_a_step_moved_before_its_cause_without_a_trace_is_refused_by_the_spec(deployment,
                                                                              tmp_path):
    """The forger rewrites the stamp and drops what it follows: the merge puts the Reserve
    before its request's Arrive, and the spec refuses it there."""
    _, parts = deployment
    line = {}

    def edit(logs):
        line["k"] = _line(logs, "decode-1.ndjson", "Reserve")
        logs["decode-1.ndjson"][line["k"] - 1].update(c=1, after=[])
    folder, _ = _forge(parts, tmp_path, edit)
    says = _refused(folder)
    assert says.startswith(f"{folder / 'decode-1.ndjson'} line {line['k']} (merged event 2): "
                           "step 2 (Reserve(r3"), says
    assert "is not a step of the spec" in says and "the request has not arrived" in says, says


@pytest.mark.parametrize("where", ["middle", "end"])
def test_a_dropped_step_is_refused(deployment, tmp_path, where):
    _, parts = deployment
    line = {}

    def edit(logs):
        records = logs["prefill-0.ndjson"]
        k = 5 if where == "middle" else len(records) - 2  # the last step, before LogEnd
        line["step"] = records[k - 1]["k"]
        line["next"] = k  # the record after it moves up to its line
        del records[k - 1]
    folder, _ = _forge(parts, tmp_path, edit)
    says = _refused(folder)
    assert says.startswith(f"{folder / 'prefill-0.ndjson'} line {line['next']}: prefill 0's "
                           f"step {line['step']} is missing"), says


def test_a_step_logged_by_a_part_that_does_not_take_it_is_refused(deployment, tmp_path):
    """decode 1's last step, relabelled as decode 0's next (both logs' ends adjusted, so
    every stamp is consistent): the router placed the request on decode 1."""
    _, parts = deployment
    line = {}

    def edit(logs):
        one, zero = logs["decode-1.ndjson"], logs["decode-0.ndjson"]
        step = one[-2]
        del one[-2]
        one[-1]["steps"] -= 1
        step.update(part="decode 0", k=zero[-1]["steps"] + 1,
                    c=max(step["c"], zero[-2]["c"] + 1))
        zero.insert(len(zero) - 1, step)
        zero[-1]["steps"] += 1
        line["k"], line["action"] = len(zero) - 1, step["a"]
    folder, _ = _forge(parts, tmp_path, edit)
    says = _refused(folder)
    assert says.startswith(f"{folder / 'decode-0.ndjson'} line {line['k']}: "
                           f"{line['action']}("), says
    assert "is decode 1's to take, but decode 0 logged it" in says, says


def test_the_cli_validates_a_deployments_logs(capsys, deployment, tmp_path):
    _, parts = deployment
    code, out, err = cli(capsys, "validate", str(parts))
    assert code == 0, out + err
    assert f"run OK: {STEPS} steps" in out
    assert "6 logs of one deployment merged: router 9 steps, prefill 0 18 steps" in out
    files = [str(p) for p in random.Random(3).sample(_files(parts), 6)]
    code, out, _ = cli(capsys, "validate", *files)
    assert code == 0 and f"run OK: {STEPS} steps" in out

    def edit(logs):
        del logs["router.ndjson"][3]
    folder, _ = _forge(parts, tmp_path, edit)
    code, out, _ = cli(capsys, "validate", str(folder))
    assert code == 1, out
    assert f"{folder / 'router.ndjson'} line 4: router's step 3 is missing" in out


def test_the_cli_refuses_a_file_that_is_not_a_part_log_among_them(capsys, deployment):
    single, parts = deployment
    code, out, err = cli(capsys, "validate", str(single), *map(str, _files(parts)))
    assert code == 2, out + err
    assert f"{single} is not a part log" in err and len(err.strip().splitlines()) == 1


# -- random runs: every merge is a run the core takes ----------------------------------------

def _random_runs(runs: int) -> tuple[int, int]:
    """Seeds 0..runs-1 of 40 enabled events on two requests over 2 x 2 workers with every
    loss and crash: (runs whose merged logs the core refuses somewhere, events taken)."""
    m, refused, taken = TWO_REQUESTS_LOSSY_2X2, 0, 0
    for seed in range(runs):
        logs = PartLogs(m)
        for _, event, _ in behaviour(m, random.Random(seed), 40):
            logs.take(event)
            taken += 1
        merged = merge(m, [(name, list(enumerate(records, start=2)))
                           for name, records in logs.logs().items()])
        t, where = core.initial_state(m), {}
        for record in merged.records:
            t = core.apply(m, t, flat_event(m, codec.decode(record), where))
            if type(t) is core.Refusal:
                refused += 1
                break
    return refused, taken


def test_every_merge_of_random_runs_is_a_run_the_core_takes():
    assert _random_runs(300) == (0, 2907)


def test_without_the_one_slot_rule_some_merges_are_not_runs(monkeypatch):
    """A send not ordered after the receiver's earlier steps: the merge may put a step that
    emptied the receiver's slot after a send that refilled it."""
    monkeypatch.setattr(PartLogs, "_stands_on", lambda self, taker, event: [
        part for part in self._request_parts(event) if part is not taker]
        if taker.read_assumption else [])
    assert _random_runs(300) == (3, 2907)


def test_a_missing_log_is_refused(deployment, tmp_path):
    _, parts = deployment

    def edit(logs):
        del logs["decode-1.ndjson"]
    folder, _ = _forge(parts, tmp_path, edit)
    assert _refused(folder).startswith("no log of this deployment ends decode 1's")
