"""A worker process whose own loop hangs while its channel's threads run on
(engine/processes.py `Process.loop_alive`, engine/channel.py `Channel.alive`). Its
heartbeats used to go on from the channel's ticker thread, so nobody ever declared it down
and what it held waited for good. Now the channel beats only while the loop turns: the
peers declare it down within 2 x suspect_after_s, the router fences it (its launcher kills
it) and the crash's path ends what it held."""

from __future__ import annotations

import json

from engine.processes import log_path
from tests.cli_cases import run as cli
from tests.test_processes import (WAIT_S, _reports, assert_whole, deployment, merged_run,
                                  run_closed)


def test_a_prefill_whose_loop_hangs_is_declared_down_fenced_and_restarted(tmp_path, capsys):
    """The one prefill of a 1 x 2 deployment hangs right after its first Admit (its loop
    blocks for good; its channel's threads, the heartbeats' thread among them, run on).
    Both decodes and the router declare it down within 2 x suspect_after_s (plus slack);
    the router has it fenced and restarted; what was placed on it until then ends
    ErrPrefill, the later requests are served by its new life, every pool is whole, and
    the logs validate."""
    d = deployment(tmp_path, 1, 2, compute_s=0.05, arrive_every_s=0.5,
                   hang_after_step="prefill 0:Admit")
    ran = run_closed(d, WAIT_S + 4 * d.suspect_after_s)
    done, stopped = ran.done, ran.stopped
    seen = {name: child.seen for name, child in ran.launched.children.items()}
    restart = _reports(ran.launched, "router", "restart")[0]["restart"]
    steps = [x for x in map(json.loads, log_path(d, "prefill 0").read_text().splitlines()[1:])
             if x.get("a") != "LogEnd"]
    hung = steps[0]
    assert hung["a"] == "Admit" and steps[1]["a"] == "PrefillCrash"  # nothing after the hang
    downs = {name: [x for x in reports if x["ev"] == "peer_down" and x["peer"] == "prefill 0"]
             for name, reports in seen.items() if name in ("router", "decode 0", "decode 1")}
    silence = "nothing heard for suspect_after_s"
    for name, found in downs.items():
        print(f"{name} declared prefill 0 down: {[x['reason'] for x in found]}")
        # Once for its silence at most (its second life does not hang); its second life's
        # connection closes as the deployment stops.
        assert sum(silence in x["reason"] for x in found) <= 1, (name, found)
    # The router, which fences, declares it down for its silence (its first life's
    # connection was open, its threads alive): with heartbeats from the channel's own
    # thread nobody ever would.
    fenced_at = downs["router"][0]["at_s"]
    assert silence in downs["router"][0]["reason"], downs["router"]
    for name in ("decode 0", "decode 1"):
        # Each decode declares its first life down for the same silence, or, when the
        # router's fence kills it a moment before the decode's own read times out (the
        # three detectors fire within milliseconds of each other: a race on a loaded
        # machine), for the connection the kill breaks, never before that fence.
        first = downs[name][0]
        assert (silence in first["reason"] or ("the connection broke" in first["reason"]
                                               and first["at_s"] >= fenced_at)), downs[name]
    assert stopped["router"]["restarts"] == ["prefill 0"]
    # What was placed on it before its restart ends ErrPrefill (its first life ended
    # nothing: it hung at its first Admit); what came after is served by its new life.
    outcomes = dict(enumerate(done["outcomes"]))
    lost = {r for r, _, _ in restart["placed"]}
    print(f"ErrPrefill {sorted(lost)}; outcomes {done['outcomes']}")
    assert hung["request"] in lost and len(lost) < len(outcomes)
    assert {r for r, o in outcomes.items() if o == "ErrPrefill"} == lost
    assert all(o == "Ok" for r, o in outcomes.items() if r not in lost), outcomes
    assert_whole(stopped)
    merged, verdict = merged_run(tmp_path)
    code, out, err = cli(capsys, "validate", str(tmp_path))
    assert code == 0 and f"run OK: {verdict.steps} steps" in out, out + err
